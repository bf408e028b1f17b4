"""Small helpers with no better home (kept import-light)."""
