"""Griffe extension: a docstring's ``Example:`` block is read as Google style's ``Examples:`` section.

The package's docstrings head their doctests ``Example:`` (as Napoleon and ``--doctest-modules`` take
them); Griffe's Google parser knows only ``Examples:`` and would render the doctest's output lines as
Markdown (``[2.0, 0.5]`` as a link). Nothing else in a docstring is changed.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", flags=re.M)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\g<indent>Examples:", obj.docstring.value)
