"""Layer 6, the command line: `python -m labkit doctor | bench | images | launch
| export | results | clean-notebooks | student | nbgrader | footprint`, and the
builds behind `make book` and `make slides` (site, editions, vendor). May import
every layer's face; nothing imports it."""
