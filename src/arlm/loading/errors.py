"""The one error type loading raises for bad user input (paths, files, formats)."""


class LoadError(ValueError):
    """A model could not be loaded; the message says why in one line."""
