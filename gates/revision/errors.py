"""The one error of revision arms: a revision that cannot run (exit 4 in the CLI, with the reason)."""


class RevisionError(RuntimeError):
    """A git revision could not be resolved or checked out, or its engine failed to import or died."""
