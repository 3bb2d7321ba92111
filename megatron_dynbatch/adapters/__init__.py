"""Kept import paths for tools outside this package (slime's patches): thin re-exports."""
