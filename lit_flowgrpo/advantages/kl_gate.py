"""GARDO's gated KL (arXiv:2512.24138, Sec. 4.1) in the advantage stage: the controller that moves the
gated share along the run (:class:`KLGateController`, a :class:`~lit_flowgrpo.parts.Part`: its state is
checkpointed), and the transform that turns the gathered reward components into KL weights
(:class:`GatedKL`). The settings are :class:`~lit_flowgrpo.kl.KLGate` (``--model.init_args.kl.gate``).

The settings hold no run state: a settings object can be shared, copied or compared, and the controller
of each run is its own (the module makes it and registers it among its parts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lit_flowgrpo.advantages.columns import AdvantageState
from lit_flowgrpo.algorithms import gardo_uncertainty, gated_kl_weights
from lit_flowgrpo.errors import MODEL
from lit_flowgrpo.kl import KLGate
from lit_flowgrpo.parts import AfterUpdate

__all__ = ["GatedKL", "KLGateController"]


class KLGateController:
    """The gated share of one run (a :class:`~lit_flowgrpo.parts.Part`): GARDO's risk controller when the
    gate is ``adaptive``, the fixed ``fraction`` otherwise.

    It moves in the advantage stage, once per rollout batch, on that batch's uncertainties (GARDO moves
    it before the update, from the batch it gates): :meth:`weights`. ``after_update`` leaves it alone,
    and logging only reads it.

    Its checkpoint entry is ``{"fraction": float, "risks": [float, ...]}`` under ``kl_gate``, the form
    checkpoints have always held; a checkpoint without one (written without a gate) leaves the
    controller where it starts.

    Args:
        gate: the settings it follows.
    """

    key = "kl_gate"

    def __init__(self, gate: KLGate) -> None:
        self.gate = gate
        self.fraction = float(gate.fraction)
        self.risks: list[float] = []

    def observe(self, uncertainty: Tensor) -> float:
        """Move the gated share with this batch's risk (when adaptive) and return the share to gate.

        GARDO's controller (``adaptive``): the risk is the mean positive uncertainty; above every one of
        the last ``window`` batches' the share grows by 1 + ``rate``, below every one it shrinks by
        1 − ``rate``, within ``fraction_range``. A batch with no positive uncertainty says nothing of the
        risk and moves nothing."""
        positive = uncertainty[uncertainty > 0]
        if self.gate.adaptive and positive.numel():
            risk = float(positive.mean())
            if self.risks and risk > max(self.risks):
                self.fraction *= 1 + self.gate.rate
            elif self.risks and risk < min(self.risks):
                self.fraction *= 1 - self.gate.rate
            low, high = self.gate.fraction_range
            self.fraction = min(max(self.fraction, low), high)
            self.risks = [*self.risks, risk][-self.gate.window :]
        return self.fraction

    def weights(
        self, proxy: Tensor, auxiliary: Tensor, trained: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """(N,) KL weights of every rank's samples and what to log; moves the share when adaptive.

        Args:
            proxy: (N,) the trained reward of every rank's samples.
            auxiliary: (K, N) the rewards that judge it.
            trained: (N,) bool, the samples the update trains; the weights are normalised over them (all
                when ``None``).

        Returns:
            ((N,) fp32 weights, ``actor/kl_gated_fraction``: the share of the whole batch the gate picks,
            and ``actor/kl_gate_target``: the share it aims at).
        """
        u = gardo_uncertainty(proxy, auxiliary)
        fraction = self.observe(u)
        w = gated_kl_weights(u, fraction, trained)
        # The gate's pick over the whole batch, before the update drops any sample (GARDO's decision).
        picked = w if trained is None else gated_kl_weights(u, fraction)
        gated = float((picked > 0).float().mean())
        return w, {"actor/kl_gated_fraction": gated, "actor/kl_gate_target": fraction}

    def state_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "risks": list(self.risks)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:  # written without a gate (or before it had state): start afresh
            return
        missing = [k for k in ("fraction", "risks") if k not in state]
        if missing:
            raise ValueError(
                f"the checkpoint's kl_gate entry lacks {missing} (it holds {sorted(state)}): it was not "
                "written by the KL gate's controller; resume with the run's own checkpoint"
            )
        self.fraction = float(state["fraction"])
        self.risks = [float(r) for r in state["risks"]]

    def after_update(self, done: AfterUpdate) -> None:
        pass  # it moved in the advantage stage, on the batch it gated


@dataclass(frozen=True)
class GatedKL:
    """The KL gate as a transform: the proxy and auxiliary components in, every rank's KL weights out,
    normalised over the samples the update trains (so it runs after ``filter_zero``).

    Args:
        controller: the run's controller (it moves here).
    """

    controller: KLGateController
    label: str = f"{MODEL}.kl.gate"

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.controller.gate.proxy, *self.controller.gate.auxiliary)

    def __call__(self, state: AdvantageState) -> AdvantageState:
        gate = self.controller.gate
        proxy = state.columns[gate.proxy]
        auxiliary = torch.stack([state.columns[name] for name in gate.auxiliary])  # (K, N)
        weights, log = self.controller.weights(proxy, auxiliary, state.keep.to(proxy.device))
        return state.replace(kl_weights=weights.to(state.values.device), log=log)
