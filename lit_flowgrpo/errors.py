"""The one exception type for a setting or input file the user can fix: ``SettingsError``.

Raised by every check of ours that runs before the first rollout (constructors, ``setup``, the CLI's
checks on the parsed config, a remote reward's start-up check). ``lit-flowgrpo`` prints its message
alone, ``lit-flowgrpo: error: ...``, and exits with status 2, whichever stage raised it: Lightning
re-raises an exception from a hook unchanged, so the type survives ``trainer.fit``. Any other
exception is a bug, and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["MODEL", "SettingsError", "flag"]


class SettingsError(ValueError):
    """A setting or an input file that cannot work, with the flag to change and how.

    A ``ValueError``, so Python callers that caught the ``ValueError`` these checks raised before
    still catch them.
    """


#: The command-line path of each part of ``FlowGRPOModule``, in the one spelling the CLI accepts
#: (the module is parsed in subclass mode: ``--model.init_args.<part>``), for error messages.
MODEL = "--model.init_args"


def flag(part: str) -> str:
    """``flag("update")`` → ``--model.init_args.update``; for the parts given by ``class_path``, their
    settings: ``flag("objective")`` → ``--model.init_args.objective.init_args`` (and the reward's)."""
    if part in ("objective", "reward"):
        return f"{MODEL}.{part}.init_args"
    return f"{MODEL}.{part}"
