"""Built-in cases: one TOML file each, loaded by ``accumcheck.case.definition``."""
