"""The KL regulariser as one group of settings: β and the form of the KL, which reference it holds the
policy to and how that reference moves, and GARDO's gate that puts it on some samples only
(``--model.init_args.kl``).

Each of these had its own owner before (the objective's ``kl_coef`` and ``kl_with_dt``, the module's
``reference`` and ``reference_copy``, the advantage stage's ``kl_gate``, the diagnostics'
``reference_kl``), and the rules between them (a gate needs a β, a moving reference needs a KL, a full
fine-tune's reference needs a copy) were checked wherever one of them happened to be read. Here they are
one object, checked once (:meth:`KLSettings.problems`), resolved once (:meth:`KLSettings.resolved`), and
read by the parts that act on them: the objectives (β, the form), the copies (the reference), the
advantage stage (the gate).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from lit_flowgrpo.errors import MODEL
from lit_flowgrpo.errors import flag as flag_of

__all__ = ["KLGate", "KLSettings", "ReferenceSettings"]

_FLAG = f"{MODEL}.kl"


@dataclass
class ReferenceSettings:
    """Which policy the KL penalty holds the trained one to.

    ``initial`` (the default) is the model as it was before training: with LoRA the network with its
    adapter switched off, for a full fine-tune the frozen copy (``copy``). Holding a policy to
    its starting point for the whole run makes the penalty grow as the policy improves, until it stops
    learning; GARDO (arXiv:2512.24138, Sec. 4.2) moves the reference along instead:

    - ``refreshed``: the reference is set to the trained weights every ``refresh_every`` optimizer steps,
      and after any update whose mean KL to it (``actor/kl_loss``, over every rank) exceeded
      ``refresh_kl``, whichever comes first. GARDO's released script refreshes once more than
      ``reset_freq`` (15) epochs have passed since the last refresh, i.e. every ``reset_freq`` + 1 = 16
      epochs: at its 2 optimizer steps an epoch that is ``refresh_every: 32``
      ((``reset_freq`` + 1) × ``optimizer_steps_per_rollout``; 30 would refresh one epoch early). It
      also refreshes after an epoch in which any one optimizer step's KL passed ``kl_thres`` (3e-4 in
      its OCR/GenEval configs), where this compares the mean over the update's optimizer steps: the
      same with one optimizer step per rollout, a later refresh with more. And its KL is in another
      unit: ``refresh_kl`` ≈ ``kl_thres``/P, P the share of its micro-batches that hold a gated sample
      (:class:`~lit_flowgrpo.kl.KLGate`; without a gate P = 1);
    - ``ema``: after each update, ref ← ``ema_decay``·ref + (1 − ``ema_decay``)·θ, a reference that trails
      the policy by about 1/(1 − ``ema_decay``) updates.

    Under either, the reference is a stored copy of the trained tensors (the adapter's, or the whole
    transformer's in ``copy``) that is saved in checkpoints, so a resumed run holds the same
    reference.

    ``offload`` keeps a full fine-tune's frozen copy (``copy``) in host memory, pinned, under
    ``--trainer.strategy=fsdp2``: FSDP2's ``CPUOffloadPolicy`` holds each rank's shards on the host and
    copies a block's shards in for its all-gather, so the reference costs no GPU memory beyond the
    block being computed (FLUX.1's 24 GB in bf16, 6 GB per GPU on 4), for a host-to-device copy of the
    rank's shards per reference forward. The copy is exact: the KL is the same, bit for bit.

    Args:
        mode: ``initial``, ``refreshed`` or ``ema``.
        refresh_every: ``refreshed``: optimizer steps between refreshes (``None``: only on ``refresh_kl``).
        refresh_kl: ``refreshed``: refresh after an update whose mean KL to the reference is above this
            (``None``: only every ``refresh_every``).
        ema_decay: ``ema``: the reference's decay per update, in [0, 1).
        copy: full fine-tune only: keep a frozen copy of the initial transformer as the reference (with
            LoRA the reference is the same network with its adapter switched off).
        offload: keep the frozen reference copy in host memory (fsdp2 only; see above).
    """

    mode: Literal["initial", "refreshed", "ema"] = "initial"
    refresh_every: int | None = None
    refresh_kl: float | None = None
    ema_decay: float = 0.9
    copy: bool = False
    offload: bool = False

    def problems(self, uses_reference: bool, flag: str = f"{MODEL}.kl.reference") -> list[str]:
        p = []
        if self.mode not in ("initial", "refreshed", "ema"):
            return [f"{flag}.mode ({self.mode!r}) must be one of initial, refreshed, ema"]
        if self.refresh_every is not None and self.refresh_every < 1:
            p.append(
                f"{flag}.refresh_every ({self.refresh_every}) must be at least 1 optimizer step, or null to "
                "refresh only on refresh_kl"
            )
        if self.refresh_kl is not None and not self.refresh_kl > 0:
            p.append(
                f"{flag}.refresh_kl ({self.refresh_kl}) must be > 0, or null to refresh only every refresh_every"
            )
        if self.mode == "refreshed" and self.refresh_every is None and self.refresh_kl is None:
            p.append(
                f"{flag}.mode=refreshed needs {flag}.refresh_every or {flag}.refresh_kl (GARDO uses both: e.g. "
                "refresh_every: 32, refresh_kl: 3.0e-4)"
            )
        if self.mode != "refreshed" and (self.refresh_every is not None or self.refresh_kl is not None):
            p.append(
                f"{flag}.refresh_every / refresh_kl only apply to {flag}.mode=refreshed (mode is {self.mode!r}): "
                "set the mode or drop them"
            )
        if not 0 <= self.ema_decay < 1:
            p.append(f"{flag}.ema_decay ({self.ema_decay}) must lie in [0, 1)")
        if self.mode != "initial" and not uses_reference:
            p.append(
                f"{flag}.mode={self.mode} moves the KL reference, but no KL to it is computed: set "
                f"{MODEL}.kl.coef > 0 (or {MODEL}.kl.measure=true to only measure it), or drop the setting"
            )
        return p


@dataclass
class KLGate:
    """GARDO's gated KL (arXiv:2512.24138, Sec. 4.1): the KL penalty only on the samples whose trained
    reward looks least trustworthy, the rest trained freely.

    Each sample's uncertainty is how much more the trained (``proxy``) reward ranks it than the
    ``auxiliary`` rewards do (:func:`~lit_flowgrpo.algorithms.gardo_uncertainty`, over every rank's
    batch); the top ``fraction`` of the samples it over-rates carry the KL, as a mean over them
    (:func:`~lit_flowgrpo.algorithms.gated_kl_weights`). The auxiliary rewards are reward components
    scored but not trained on (weight 0 in the ``MultiReward``), as GARDO's aesthetic and ImageReward
    scores are beside its proxy.

    ``adaptive``: GARDO's controller moves ``fraction`` with the risk it sees: the batch's mean positive
    uncertainty above every one of the last ``window`` batches multiplies it by 1 + ``rate``, below
    every one by 1 − ``rate``, kept within ``fraction_range`` (the released script: 0.1 to start, ×1.1 or
    ×0.9, window 20, range [0.02, 0.2]). Its state is checkpointed (:class:`~lit_flowgrpo.advantages.KLGateController`).

    The penalty's unit differs from GARDO's code, so its β and ``kl_thres`` do not carry over as they
    are. Here β multiplies the mean KL over every gated sample the update trains (the weights of
    :func:`~lit_flowgrpo.algorithms.gated_kl_weights`), whatever the micro-batches. GARDO's script takes
    the mean over the gated samples of each micro-batch, and 0 for a micro-batch with none, so its
    penalty, and the KL it logs and compares with ``kl_thres``, is ours times the share P of its
    micro-batches that hold a gated sample: P ≈ 1 − (1 − g)^b for a gated share g of the trained
    samples and b samples a micro-batch (GARDO's OCR recipe: g ≈ 0.05, half the batch over-rated times
    its fraction 0.1, and b = 9 give P ≈ 0.37; the 5% gated in this package's shapes-world runs with
    b = 32 give P ≈ 0.8). So β_ours ≈ P·β_GARDO, and ``reference.refresh_kl`` ≈ ``kl_thres``/P
    (:class:`ReferenceSettings` says how the refresh itself differs).

    Args:
        proxy: the reward component trained on (a key of the reward's components, e.g. ``shapes_color``).
        auxiliary: the components that judge it (at least one).
        fraction: the share of the over-rated samples gated (to start with, when ``adaptive``), in (0, 1].
        adaptive: move ``fraction`` with the uncertainty, as above.
        fraction_range: ``adaptive``: the bounds of ``fraction``.
        rate: ``adaptive``: the relative step of ``fraction``.
        window: ``adaptive``: the batches the risk is compared with.
    """

    proxy: str = ""
    auxiliary: list[str] = field(default_factory=list)
    fraction: float = 0.1
    adaptive: bool = True
    fraction_range: tuple[float, float] = (0.02, 0.2)
    rate: float = 0.1
    window: int = 20

    def __post_init__(self) -> None:
        self.fraction_range = tuple(self.fraction_range)  # type: ignore[assignment]  # YAML gives a list

    def problems(self, flag: str, weights: dict[str, float] | None) -> list[str]:
        """Every problem with these settings, and with the reward's component ``weights`` where known."""
        p = []
        if not 0 < self.fraction <= 1:
            p.append(
                f"{flag}.fraction ({self.fraction}) must lie in (0, 1]: the share of over-rated samples gated"
            )
        low, high = self.fraction_range
        if not 0 < low <= high <= 1:
            p.append(f"{flag}.fraction_range ({list(self.fraction_range)}) must satisfy 0 < low <= high <= 1")
        elif self.adaptive and not low <= self.fraction <= high:
            p.append(
                f"{flag}.fraction ({self.fraction}) must lie within fraction_range {list(self.fraction_range)}"
            )
        if not 0 < self.rate < 1:
            p.append(f"{flag}.rate ({self.rate}) must lie in (0, 1)")
        if self.window < 1:
            p.append(f"{flag}.window ({self.window}) must be at least 1")
        if not self.proxy:
            p.append(f"{flag}.proxy is empty: name the reward component trained on, e.g. shapes_color")
        if not self.auxiliary:
            p.append(
                f"{flag}.auxiliary is empty: name at least one reward component that judges the proxy "
                "(scored with weight 0), e.g. [shapes/partial]"
            )
        if self.proxy and self.proxy in self.auxiliary:
            p.append(
                f"{flag}.auxiliary names the proxy {self.proxy!r} itself: a reward judged by itself is never "
                "over-rated (uncertainty 0), so no sample would carry the KL; name other components"
            )
        if weights is not None:
            unknown = [c for c in [self.proxy, *self.auxiliary] if c and c not in weights]
            if unknown:
                p.append(
                    f"{flag} names {unknown}, which the reward does not compute (its components: "
                    f"{list(weights)}): add them to the reward's weights (weight 0 scores without training on it)"
                )
            elif self.proxy and weights[self.proxy] == 0:
                trained = [c for c, w in weights.items() if w != 0]
                p.append(
                    f"{flag}.proxy ({self.proxy!r}) has weight 0 in {flag_of('reward')}.weights: the gate "
                    f"judges the reward that is trained, so name a trained component ({trained}) or weight it"
                )
        return p


@dataclass
class KLSettings:
    """The KL regulariser: β·KL(π_θ ‖ π_ref) added to the objective's loss.

    For the ratio objectives (Flow-GRPO, GRPO-Guard, Flow-DPPO) the KL of the step's Gaussian
    transitions, mean((μ_θ − μ_ref)²)/(2·std_dev_t²) (the published code; ``with_dt``: the paper's, also
    divided by |dt|); for DiffusionNFT its reference's regulariser mean((v_θ − v_ref)²).

    Args:
        coef: β (0 turns the reference forward off); ``None`` takes the objective's published value
            (``default_kl_coef``: 0 for the ratio objectives, 1e-4 for DiffusionNFT).
        with_dt: the paper's KL, which also divides by |dt| (ratio objectives).
        measure: run the reference forward and log the KL to it (``actor/kl_loss``) even at β = 0, where
            the loss does not use it: the drift from the reference as a curve, for one more transformer
            forward per visit.
        reference: which policy the KL holds the trained one to, and how it moves
            (:class:`ReferenceSettings`).
        gate: GARDO's gated KL (:class:`KLGate`): the penalty on the samples the trained reward
            over-rates only; ``None`` puts it on every sample.
    """

    coef: float | None = None
    with_dt: bool = False
    measure: bool = False
    reference: ReferenceSettings = field(default_factory=ReferenceSettings)
    gate: KLGate | None = None

    def resolved(self, default_coef: float) -> KLSettings:
        """A copy with β resolved (``coef`` None: ``default_coef``, the objective's)."""
        return replace(self, coef=default_coef if self.coef is None else float(self.coef))

    @property
    def on(self) -> bool:
        """The KL enters the loss (β > 0)."""
        return bool(self.coef)

    @property
    def runs_reference(self) -> bool:
        """A visit runs the reference forward: the KL enters the loss, or is measured."""
        return self.on or self.measure

    def problems(self, *, full_fine_tune: bool, reward_weights: dict[str, float] | None = None) -> list[str]:
        """Every problem with these settings (β resolved), with the weights trained (``full_fine_tune``)
        and the reward's component weights where known; each names its flag."""
        p = []
        if self.coef is not None and not self.coef >= 0:
            p.append(f"{_FLAG}.coef ({self.coef}) must be >= 0 (Flow-GRPO's recipes 0.04, DiffusionNFT 1e-4)")
        p += self.reference.problems(self.runs_reference)
        ref = f"{_FLAG}.reference"
        if full_fine_tune and self.runs_reference and not self.reference.copy:
            p.append(
                f"the KL to the reference ({_FLAG}.coef > 0 or {_FLAG}.measure) with a full fine-tune "
                f"({MODEL}.weights.lora=null) needs {ref}.copy=true (a frozen copy of the initial transformer "
                "as the reference)"
            )
        if not full_fine_tune and self.reference.copy:
            p.append(
                f"{ref}.copy=true is for full fine-tunes: with {MODEL}.weights.lora the reference is the "
                "network with its adapter switched off; drop one of the two"
            )
        if self.reference.offload and not (full_fine_tune and self.reference.copy):
            p.append(
                f"{ref}.offload=true offloads a full fine-tune's frozen reference copy, and this run has none "
                f"(with {MODEL}.weights.lora the reference is the network with its adapter off; a full "
                f"fine-tune needs {ref}.copy=true): drop it"
            )
        if self.gate is not None:
            p += self.gate.problems(f"{_FLAG}.gate", reward_weights)
            if not self.on:
                p.append(
                    f"{_FLAG}.gate gates the KL penalty, but there is none: set {_FLAG}.coef > 0 (GARDO's OCR "
                    "recipe: 0.04), or drop the gate"
                )
        return p
