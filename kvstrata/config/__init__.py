"""Configuration: the YAML file, the frozen config dataclasses and their sections (model, remote, load), secrets.
May import: errors, system, identity."""
