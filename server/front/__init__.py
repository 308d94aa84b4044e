"""The daemon's connections, in front of aiohttp: site.py listens, connection.py reads each request
head and serves bulk uploads natively (bulk_put.py, bulk_body.py; heads in head.py), and hands
every other request to aiohttp."""
