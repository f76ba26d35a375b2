"""Layer 6, the command line: `python -m labkit doctor | bench | images |
clean-notebooks | launch | student`. May import every layer; nothing imports it."""
