"""Errors a caller can act on, each with a message that names what was found."""


class JaxserveError(Exception):
    """Base of the errors jaxserve raises on purpose."""


class CheckpointError(JaxserveError):
    """A model directory is missing a file, or holds something we cannot run."""


class TableError(JaxserveError, ValueError):
    """A bucket table, or the options to derive one, that this model cannot be served with."""


class InputError(JaxserveError):
    """A request's documents cannot be run as asked."""


class TooLongError(InputError):
    """A document is over the model's limit and neither truncation nor chunking was allowed."""


class TokenizerError(InputError):
    """The tokenizer could not read an input (it raised, or panicked): the input's fault, not the server's."""
