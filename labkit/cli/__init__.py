"""Layer 6, the command line: `python -m labkit doctor | bench | images |
clean-notebooks | launch`. May import every layer; nothing imports it."""
