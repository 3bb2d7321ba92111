"""Kept import paths for tools outside this package (slime's patches): re-exports, and thin
wrappers where the host's flag names must appear in errors."""
