"""The one exception type for a setting or input file the user can fix: ``SettingsError``.

Raised by every check of ours that runs before the first rollout (constructors, ``setup``, the CLI's
checks on the parsed config, a remote reward's start-up check). ``lit-flowgrpo`` prints its message
alone, ``lit-flowgrpo: error: ...``, and exits with status 2, whichever stage raised it: Lightning
re-raises an exception from a hook unchanged, so the type survives ``trainer.fit``. Any other
exception is a bug, and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["SettingsError"]


class SettingsError(ValueError):
    """A setting or an input file that cannot work, with the flag to change and how.

    A ``ValueError``, so Python callers that caught the ``ValueError`` these checks raised before
    still catch them.
    """
