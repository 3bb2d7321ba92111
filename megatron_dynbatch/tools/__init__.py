"""What users and tests run on top of the library: the CLI, plotting, ``verify``, test support."""
