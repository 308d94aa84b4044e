def add_parser(sub):  # replaced by the benchmark helper
    pass
