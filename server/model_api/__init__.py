"""The model server: OpenAI- and Anthropic-compatible routes over the engine, beside the cache API.

One request:

    HTTP POST /v1/chat/completions | /v1/responses | /v1/messages            routes.py
      │  body bounded, JSON checked
      ▼
    recipe request (deepseek-recipe: ChatCompletionRequest | ResponsesRequest | MessagesRequest)
      │  .model served?  convert(options)                                     conversation.py
      ▼
    ConversationRequest ─ encoding.encode(conversation) ─> prompt ids, the cache point after
      │                                                    the last <｜Assistant｜>
      │  sampling fields ─> SamplingParams, max_tokens within the context     sampling_fields.py
      ▼  admission (queue bound, tenant limits)                               admission.py
    AsyncEngine.generate(ids, params) ─ token ids as they are sampled         stream.py
      │
      ▼
    StreamProcessor (reasoning, tool calls, stop strings) ─ recipe chunks
      │
      ├─ stream:  SSE frames (event name, JSON; [DONE] for chat)
      └─ else:    accumulated into the API's response object ─ JSON
                  usage: prompt, cached (prefix cache), per-tier split         metrics.py, access_log.py

/v1/completions (completions.py) skips the recipe: text or token ids straight to the engine.
host.py loads the checkpoint (or builds the demo one) and owns the engine, loading.py runs that
after the port opened; errors.py is every route's error shape.
"""
