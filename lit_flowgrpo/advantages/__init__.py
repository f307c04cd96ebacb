"""From rewards to advantages: the advantage stage as a sequence of small transforms over every rank's
gathered columns.

- :mod:`~lit_flowgrpo.advantages.stage`: :class:`AdvantageSettings` (the YAML settings, the transforms
  they make, the stage's one function ``for_batch``) and its result :class:`BatchAdvantages`;
- :mod:`~lit_flowgrpo.advantages.columns`: the seam: named gathered columns, the state the transforms
  pass along, what a transform declares;
- :mod:`~lit_flowgrpo.advantages.transforms`: group normalisation, GDPO, the failure budget, GARDO's
  diversity bonus, ``filter_zero``;
- :mod:`~lit_flowgrpo.advantages.kl_gate`: GARDO's KL gate (settings: :class:`~lit_flowgrpo.kl.KLGate`), its controller (a part with
  state, checkpointed).

The math is the pure functions of :mod:`lit_flowgrpo.algorithms`.
"""

from lit_flowgrpo.advantages.columns import (
    AdvantageState,
    AdvantageTransform,
    Columns,
    MissingColumnError,
    declared_columns,
)
from lit_flowgrpo.advantages.kl_gate import GatedKL, KLGateController
from lit_flowgrpo.advantages.stage import AGGREGATIONS, BUILT_IN_COLUMNS, AdvantageSettings, BatchAdvantages
from lit_flowgrpo.advantages.transforms import (
    DiversityBonus,
    DiversityScaling,
    DropZeroAdvantages,
    FailureBudget,
    GDPONormalisation,
    GroupNormalisation,
)

__all__ = [
    "AGGREGATIONS",
    "BUILT_IN_COLUMNS",
    "AdvantageSettings",
    "AdvantageState",
    "AdvantageTransform",
    "BatchAdvantages",
    "Columns",
    "DiversityBonus",
    "DiversityScaling",
    "DropZeroAdvantages",
    "FailureBudget",
    "GDPONormalisation",
    "GatedKL",
    "GroupNormalisation",
    "KLGateController",
    "MissingColumnError",
    "declared_columns",
]
