"""The sampler: its settings and the one denoising loop that training, validation and the toy
evaluation all use.

Steps inside the trained set use the stochastic step (``noise_level`` > 0) and are recorded; the
others (outside a Flow-GRPO-Fast window) take the deterministic ODE step and store nothing, so a
trajectory costs memory only for the steps that are trained. The :class:`Trajectory` keeps the step
settings it was drawn with, and :meth:`Trajectory.score` is the only way the update re-scores a
transition: the update cannot score under different settings than the rollout sampled with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch
from torch import Tensor

from lit_flowgrpo.conditioning import Condition
from lit_flowgrpo.policies.base import Embeds, FlowPolicy, index_embeds, latent_shape_of
from lit_flowgrpo.sde import SDEStep, SDEType, sde_step_with_logprob

__all__ = [
    "RolloutBatch",
    "Sampler",
    "Trajectory",
    "cfg_forwards",
    "initial_noise",
    "per_sample_generators",
    "sample_trajectory",
]

#: What a rollout can record of its trained steps: the transitions (x, x_next, log-prob, std, √dt)
#: and μ_old of each.
Record = Literal["transitions", "means"]
RECORDS: tuple[Record, ...] = ("transitions", "means")

#: The dtype the trajectory stores its per-step latents in (x, x_next, μ_old).
RecordDType = Literal["float32", "bfloat16"]
_RECORD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class Sampler:
    """How rollouts and validation samples are drawn.

    Args:
        num_steps: denoising steps of the rollout.
        noise_level: η of the stochastic steps.
        sde_type: ``"sde"`` (Flow-GRPO), ``"cps"`` (coefficients-preserving) or ``"dance"``.
        guidance_scale: CFG scale of the rollout (FLUX: the distilled guidance, set on the policy).
        timestep_fraction: train the first ⌊fraction·num_steps⌋ steps (Flow-GRPO 0.99: all but the
            last, whose tiny σ makes the Gaussian likelihood overflow). Ignored with a window.
        sde_window_size: Flow-GRPO-Fast: only this many consecutive steps are stochastic and trained;
            the rest are ODE steps and nothing of them is stored.
        sde_window_range: ``(lo, hi)``: the window starts at a step in [lo, hi − size], drawn per
            rollout from the seed.
        height: image height in pixels of the rollout.
        width: image width in pixels of the rollout.
        frames: frames per sample, for rollouts and validation: 1 for images (the policy then
            decodes (B, 3, H, W)); a video policy decodes (B, frames, 3, H, W) and says which counts
            it can draw (Wan: 4k + 1).
        record_dtype: dtype of the latents the trajectory keeps for each trained step (x and x_next;
            μ_old, log-probs and the final sample stay fp32). ``"bfloat16"`` halves that memory,
            which dominates at video sizes (Wan 2.1 at 33 × 240 × 416 px: 0.4 MB per sample and
            step in fp32). The chain then continues from the stored values and the recorded
            log-prob is that of the stored x_next, so the update re-scores exactly what the rollout
            scored: the on-policy ratio stays 1 (its bf16 rounding only, as the model's). μ_old is
            not rounded: the step KL to it is compared with Flow-DPPO's δ = 1e-5, and bf16's
            rounding of μ alone gives a few 1e-5 before any update; where it is recorded it costs 4
            bytes an element beside the 2 + 2 of x and x_next.
        batch_size: samples per transformer forward in the rollout and in validation (``None``: the
            whole per-rank batch at once). Each sample's noise comes from its own seed, so this only
            trades memory for speed.
        eval_num_steps: ODE steps of validation sampling.
        eval_guidance_scale: CFG scale of validation; ``None`` uses ``guidance_scale``.
        eval_height: image height of validation; ``None`` uses ``height``. Rollouts at a lower
            resolution than the one the model is judged at make each rollout cheaper.
        eval_width: image width of validation; ``None`` uses ``width``.
        eval_frames: frames of each validation clip; ``None`` uses ``frames``. Rollouts of short
            clips make each rollout cheaper while the model is judged at the length it is used at
            (Wan: rollouts at 33 frames, judged at 81). The policy checks it as it checks ``frames``.
    """

    num_steps: int = 10
    noise_level: float = 0.7
    sde_type: SDEType = "sde"
    guidance_scale: float = 4.5
    timestep_fraction: float = 0.99
    sde_window_size: int | None = None
    sde_window_range: tuple[int, int] | None = None
    height: int = 512
    width: int = 512
    frames: int = 1
    record_dtype: RecordDType = "float32"
    batch_size: int | None = None
    eval_num_steps: int = 40
    eval_guidance_scale: float | None = None
    eval_height: int | None = None
    eval_width: int | None = None
    eval_frames: int | None = None

    def __post_init__(self) -> None:
        if self.sde_window_range is not None:
            self.sde_window_range = tuple(self.sde_window_range)  # YAML gives a list

    def problems(self, flag: str = "--model.init_args.sampler") -> list[str]:
        """Every problem with these settings (empty when fine); checked before any weight is read."""
        p: list[str] = []
        for name in ("num_steps", "eval_num_steps", "height", "width", "frames"):
            if getattr(self, name) < 1:
                p.append(f"{flag}.{name} ({getattr(self, name)}) must be at least 1")
        for name in ("eval_height", "eval_width", "eval_frames"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                p.append(
                    f"{flag}.{name} ({getattr(self, name)}) must be at least 1, or null to use {name[5:]}"
                )
        if self.record_dtype not in _RECORD_DTYPES:
            p.append(f"{flag}.record_dtype ({self.record_dtype!r}) must be one of {list(_RECORD_DTYPES)}")
        if self.batch_size is not None and self.batch_size < 1:
            p.append(f"{flag}.batch_size ({self.batch_size}) must be at least 1, or null for the whole batch")
        if not self.noise_level > 0:
            p.append(
                f"{flag}.noise_level ({self.noise_level}) must be > 0: RL needs stochastic steps to score"
            )
        elif self.sde_type == "cps" and self.noise_level > 1:
            p.append(
                f"{flag}.noise_level ({self.noise_level}) must be at most 1 with {flag}.sde_type=cps: its noise "
                "σ_next·sin(η·π/2) is largest at η = 1 and gone at 2 (Flow-GRPO-Fast uses 0.8)"
            )
        if self.sde_window_size is None:
            if not 0 < self.timestep_fraction <= 1:
                p.append(f"{flag}.timestep_fraction ({self.timestep_fraction}) must lie in (0, 1]")
            elif self.num_steps >= 1 and int(self.num_steps * self.timestep_fraction) < 1:
                p.append(
                    f"{flag}.timestep_fraction ({self.timestep_fraction}) × num_steps ({self.num_steps}) "
                    "trains no step: raise either"
                )
        else:
            lo, hi = self._window_range()
            if self.sde_window_size < 1 or not 0 <= lo <= hi - self.sde_window_size or hi > self.num_steps:
                p.append(
                    f"{flag}.sde_window_size ({self.sde_window_size}) must fit in {flag}.sde_window_range "
                    f"({(lo, hi)}) within num_steps ({self.num_steps})"
                )
        return p

    def image_size_problems(self, policy: FlowPolicy, flag: str = "--model.init_args.sampler") -> list[str]:
        """The policy's objections to the rollout and validation sizes, frames included (before any
        weight is read)."""
        p = policy.image_size_problems(self.height, self.width)
        for name, frames in (("frames", self.frames), ("eval_frames", self.eval_frames)):
            if frames is None:  # eval_frames left null: the rollout's, checked as `frames`
                continue
            if isinstance(frames, int) and frames >= 1:
                p += policy.frame_problems(frames, f"{flag}.{name}")
        flags = (f"{flag}.eval_height", f"{flag}.eval_width")
        own = tuple(
            f for f, v in zip(flags, (self.eval_height, self.eval_width), strict=True) if v is not None
        )
        if own:  # a dimension left null is the rollout's, already checked above
            p += [m for m in policy.image_size_problems(*self.eval_size, flags=flags) if m.startswith(own)]
        return p

    @property
    def eval_guidance(self) -> float:
        return self.guidance_scale if self.eval_guidance_scale is None else self.eval_guidance_scale

    @property
    def eval_size(self) -> tuple[int, int]:
        """(height, width) of validation images."""
        return (
            self.height if self.eval_height is None else self.eval_height,
            self.width if self.eval_width is None else self.eval_width,
        )

    @property
    def eval_frame_count(self) -> int:
        """Frames of each validation sample (1 for images)."""
        return self.frames if self.eval_frames is None else self.eval_frames

    def settings(self) -> dict[str, object]:
        """Plain values for checkpoints and loggers."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _window_range(self) -> tuple[int, int]:
        return self.sde_window_range if self.sde_window_range is not None else (0, self.num_steps)

    def last_step_problem(self, flag: str = "--model.init_args.sampler") -> str | None:
        """How these settings can train the last step (σ_next = 0), and the fix; ``None`` when they never
        do. Asked by an objective whose loss cannot take that step (:meth:`plan` draws the steps)."""
        if self.sde_window_size is None:
            if int(self.num_steps * self.timestep_fraction) < self.num_steps:
                return None
            return (
                f"{flag}.timestep_fraction ({self.timestep_fraction}) trains the last of num_steps ({self.num_steps}): "
                "set it below 1 (Flow-GRPO: 0.99)"
            )
        lo, hi = self._window_range()
        if hi < self.num_steps:
            return None
        given = [lo, hi] if self.sde_window_range is not None else f"unset: [0, {hi}]"
        return (
            f"{flag}.sde_window_range ({given}) lets the window reach the last of num_steps ({self.num_steps}): "
            f"end it at {self.num_steps - 1} or before"
        )

    def plan(self, step: int, seed: int) -> tuple[list[int], list[int]]:
        """(stochastic steps, trained steps) of the rollout at training step ``step``."""
        if self.sde_window_size is None:
            trained = list(range(int(self.num_steps * self.timestep_fraction)))
            return list(range(self.num_steps)), trained
        lo, hi = self._window_range()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        begin = int(torch.randint(lo, hi - self.sde_window_size + 1, (1,), generator=gen))
        window = list(range(begin, begin + self.sde_window_size))
        return window, window

    def encode(
        self, policy: FlowPolicy, prompts: Sequence[str], conditions: Sequence[Condition] | None = None
    ) -> Embeds:
        """The rollout's conditioning: ``policy.encode`` of the prompts and their records' images (``None``:
        text-only) for samples of the rollout's size."""
        return policy.encode(prompts, conditions, self.height, self.width, self.frames)

    def rollout(
        self,
        policy: FlowPolicy,
        embeds: Embeds,
        seeds: Tensor,
        *,
        step: int,
        seed: int,
        record: Collection[Record] = ("transitions",),
        on_chunk: Callable[[slice, Tensor], None] | None = None,
        initial_seeds: Tensor | None = None,
    ) -> tuple[Trajectory, Tensor]:
        """Sample the training batch, recording its trained steps; returns (trajectory, images).

        Args:
            policy: the model family (put in eval mode for the duration).
            embeds: conditioning, one row per sample.
            seeds: (B,) per-sample noise seeds.
            step: the training step (chooses the Flow-GRPO-Fast window).
            seed: the run's seed (chooses the window).
            record: what to record of the trained steps (the objective's
                :attr:`~lit_flowgrpo.objective.Objective.records`): ``"transitions"`` (x, x_next,
                log-prob, std, √dt) and ``"means"`` (μ_old); the final latent is always kept.
            on_chunk: called with (rows, images) right after each chunk of ``batch_size`` samples is
                decoded, before the next one samples (the reward scores it meanwhile).
            initial_seeds: (B,) seeds of the initial noise alone (equal within a group for a shared
                start, :attr:`~lit_flowgrpo.data.PromptBatch.initial_seeds`); ``seeds`` then draws only
                the noise of the stochastic steps. ``None``: each sample's own seed draws both, in turn.
        """
        sde_steps, train_steps = self.plan(step, seed)
        networks = policy.trainable_networks
        was_training = [n.training for n in networks]
        for network in networks:
            network.eval()
        try:
            parts, images = [], []
            for rows in self._chunks(len(seeds)):
                device = _device(policy)
                generators = per_sample_generators(seeds[rows], device)
                starts = (
                    generators
                    if initial_seeds is None
                    else per_sample_generators(initial_seeds[rows], device)
                )
                shape = latent_shape_of(policy, self.height, self.width, self.frames)
                noise = initial_noise(shape, starts, device)
                traj = sample_trajectory(
                    policy,
                    index_embeds(embeds, rows),
                    noise,
                    policy.sigmas(self.num_steps, self.height, self.width),
                    guidance_scale=self.guidance_scale,
                    noise_level=self.noise_level,
                    sde_type=self.sde_type,
                    sde_steps=sde_steps,
                    train_steps=train_steps,
                    generators=generators,
                    record=record,
                    record_dtype=_RECORD_DTYPES[self.record_dtype],
                )
                images.append(policy.decode_conditioned(traj.final, index_embeds(embeds, rows)))
                parts.append(traj)
                if on_chunk is not None:
                    on_chunk(rows, images[-1])
        finally:
            for network, mode in zip(networks, was_training, strict=True):
                network.train(mode)
        return Trajectory.cat(parts), torch.cat(images)

    @torch.no_grad()
    def evaluate(
        self,
        policy: FlowPolicy,
        prompts: Sequence[str],
        seeds: Tensor,
        conditions: Sequence[Condition] | None = None,
        *,
        noise_device: torch.device | str | None = None,
        to_cpu: bool = False,
    ) -> Tensor:
        """Images (B, 3, H, W) in [0, 1] sampled with the deterministic ODE (validation, evaluation),
        at :attr:`eval_size` (videos of :attr:`eval_frame_count` frames: (B, F, 3, H, W)).

        Args:
            policy: the model family.
            prompts: one per sample.
            seeds: (B,) per-sample noise seeds.
            conditions: one per sample, the images its record conditions it on (``None``: text-only).
            noise_device: where the initial noise is drawn (``"cpu"`` makes the samples independent
                of the device); ``None``: the policy's device, as the training rollout.
            to_cpu: move each chunk's images to the host as it is done (long evaluations).
        """
        out = []
        height, width = self.eval_size
        for rows in self._chunks(len(prompts)):
            device = _device(policy)
            generators = per_sample_generators(seeds[rows], noise_device or device)
            shape = latent_shape_of(policy, height, width, self.eval_frame_count)
            noise = initial_noise(shape, generators, device)
            embeds = policy.encode(
                list(prompts[rows]),
                None if conditions is None else list(conditions[rows]),
                height,
                width,
                self.eval_frame_count,
            )
            traj = sample_trajectory(
                policy,
                embeds,
                noise,
                policy.sigmas(self.eval_num_steps, height, width),
                guidance_scale=self.eval_guidance,
                noise_level=self.noise_level,  # unused: no step is stochastic
                sde_type=self.sde_type,
                sde_steps=[],
                train_steps=[],
            )
            images = policy.decode_conditioned(traj.final, embeds)
            out.append(images.cpu() if to_cpu else images)
        return torch.cat(out)

    def _chunks(self, n: int) -> list[slice]:
        size = self.batch_size or max(n, 1)
        return [slice(i, min(i + size, n)) for i in range(0, n, size)]


@dataclass
class Trajectory:
    """What the update needs from one rollout of B samples, at its S trained steps, and the step
    settings it was drawn with."""

    latents: Tensor
    """(B, S, *latent) in the sampler's ``record_dtype`` (fp32 by default): x at each trained step."""
    next_latents: Tensor
    """(B, S, *latent) in ``record_dtype``: the recorded x_next of each trained step."""
    log_probs: Tensor
    """(B, S) fp32: log p_old(x_next | x) at rollout."""
    prev_sample_means: Tensor | None
    """(B, S, *latent) fp32 whatever ``record_dtype``: μ_old, kept only when the loss or the diagnostics
    need it (GRPO-Guard, Flow-DPPO, ``diagnostics.step_kl``)."""
    std_dev_t: Tensor
    """(B, S) fp32."""
    sqrt_dt: Tensor
    """(B, S) fp32."""
    sigmas: Tensor
    """(S,) fp32 on the CPU (read on the host at every re-score): σ of each trained step."""
    sigmas_next: Tensor
    """(S,) fp32 on the CPU."""
    step_indices: Tensor
    """(S,) int64 on the CPU: each trained step's position in the schedule."""
    final: Tensor
    """(B, *latent) fp32: the sample at σ = 0."""
    transformer_forwards: int
    """Single-sample transformer forwards per sample (CFG counts twice)."""
    noise_level: float
    """η the stochastic steps were drawn with."""
    sde_type: SDEType
    sigma_max: float | None
    """The σ used in place of σ = 1 (Flow-GRPO's second sigma)."""
    schedule: Tensor | None = None
    """(T + 1,) fp32 on the CPU: the whole σ schedule the rollout was drawn with, ending at 0 (an
    objective that re-noises the final sample at the sampler's own noise levels reads it: DiffusionNFT)."""

    @property
    def num_trained(self) -> int:
        return self.log_probs.shape[1]

    def score(self, velocity: Tensor, j: int, idx: Tensor) -> SDEStep:
        """Re-score the recorded transition of trained step ``j`` for samples ``idx`` under ``velocity``.

        The same step function and settings as the rollout, so on-policy the log-prob is bit for bit
        the recorded one (fp32, same batch composition).
        """
        return sde_step_with_logprob(
            velocity,
            self.latents[idx, j],
            float(self.sigmas[j]),
            float(self.sigmas_next[j]),
            noise_level=self.noise_level,
            sde_type=self.sde_type,
            prev_sample=self.next_latents[idx, j],
            sigma_max=self.sigma_max,
        )

    #: The per-sample fields (first dimension B), in one list: concatenation and rank balancing move
    #: exactly these. The rest are the step settings, shared by every sample.
    SAMPLE_FIELDS: ClassVar[tuple[str, ...]] = (
        "latents",
        "next_latents",
        "log_probs",
        "std_dev_t",
        "sqrt_dt",
        "final",
        "prev_sample_means",
    )

    def sample_rows(self) -> dict[str, Tensor]:
        """Every per-sample tensor by field name (the unrecorded ones left out)."""
        return {f: getattr(self, f) for f in self.SAMPLE_FIELDS if getattr(self, f) is not None}

    @staticmethod
    def cat(parts: Sequence[Trajectory]) -> Trajectory:
        """Join trajectories of the same rollout drawn in sample chunks (along the batch)."""
        if len(parts) == 1:
            return parts[0]
        rows = [p.sample_rows() for p in parts]
        return dataclasses.replace(parts[0], **{f: torch.cat([r[f] for r in rows]) for f in rows[0]})


@dataclass
class RolloutBatch:
    """This rank's rollout batch as the update walks it: the trajectory, its conditioning, the
    advantages, the sample ids and which samples are kept (finite reward, and non-zero advantage
    under ``filter_zero``). :meth:`rows` is the one list of its per-sample tensors."""

    trajectory: Trajectory
    embeds: Embeds
    """Conditioning, one row per sample."""
    advantages: Tensor
    """(B,) fp32."""
    sample_ids: Tensor
    """(B,) int64: each sample's id in the step (the metrics' key)."""
    keep: Tensor
    """(B,) bool: the samples the update trains."""
    kl_weights: Tensor | None = None
    """(B,) fp32 weight of each sample's KL penalty (GARDO's gate: :class:`~lit_flowgrpo.kl.KLGate`);
    ``None``: 1 for every sample."""

    def __len__(self) -> int:
        return len(self.advantages)

    def kl_term(self, kl: Tensor, rows: Tensor) -> Tensor:
        """The KL penalty of samples ``rows`` from their per-sample KL (N,): the mean, each sample
        weighted by :attr:`kl_weights` where there are any."""
        return kl.mean() if self.kl_weights is None else (kl * self.kl_weights[rows]).mean()

    def rows(self) -> dict[str, Tensor]:
        """Every per-sample tensor, by a name that :meth:`with_rows` reads back."""
        out = {f"trajectory.{k}": v for k, v in self.trajectory.sample_rows().items()}
        out.update({f"embeds.{k}": v for k, v in self.embeds.items()})
        out.update(advantages=self.advantages, sample_ids=self.sample_ids, keep=self.keep)
        if self.kl_weights is not None:
            out["kl_weights"] = self.kl_weights
        return out

    def with_rows(self, rows: dict[str, Tensor]) -> RolloutBatch:
        """This batch with its per-sample tensors replaced by ``rows`` (as :meth:`rows` names them)."""
        traj = dataclasses.replace(
            self.trajectory, **{k: rows[f"trajectory.{k}"] for k in self.trajectory.sample_rows()}
        )
        embeds = {k: rows[f"embeds.{k}"] for k in self.embeds}
        return RolloutBatch(
            traj, embeds, rows["advantages"], rows["sample_ids"], rows["keep"], rows.get("kl_weights")
        )

    @staticmethod
    def cat(parts: Sequence[RolloutBatch]) -> RolloutBatch:
        """Join batches along the samples."""
        rows = [p.rows() for p in parts]
        return parts[0].with_rows({name: torch.cat([r[name] for r in rows]) for name in rows[0]})


@torch.no_grad()
def sample_trajectory(
    policy: FlowPolicy,
    embeds: Embeds,
    noise: Tensor,
    sigmas: Tensor,
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: SDEType,
    sde_steps: Sequence[int],
    train_steps: Sequence[int],
    generators: Sequence[torch.Generator] | None = None,
    record: Collection[Record] = ("transitions",),
    record_dtype: torch.dtype = torch.float32,
) -> Trajectory:
    """Sample B images from ``noise`` and record the trained steps (the denoising loop).

    Args:
        policy: the model family.
        embeds: conditioning with B rows.
        noise: (B, *latent) the initial x at σ = sigmas[0].
        sigmas: (T + 1,) the schedule, ending at 0.
        guidance_scale: CFG scale of the rollout.
        noise_level: η of the stochastic steps.
        sde_type: the stochastic step's type.
        sde_steps: steps that draw noise (the rest are ODE steps).
        train_steps: steps recorded for the update (a subset of ``sde_steps``).
        generators: one generator per sample, so each sample's noise is independent of the batch.
        record: what to record of the trained steps (see :meth:`Sampler.rollout`).
        record_dtype: the dtype the per-step latents are kept in (:attr:`Sampler.record_dtype`).
    """
    sigmas = sigmas.to(torch.float32)
    num_steps = sigmas.numel() - 1
    sde_set, train_set = set(sde_steps), set(train_steps)
    if not train_set <= sde_set:
        raise ValueError(f"trained steps {sorted(train_set - sde_set)} are not stochastic steps")
    unknown = set(record) - set(RECORDS)
    if unknown:
        raise ValueError(f"unknown rollout records {sorted(unknown)}: choose from {list(RECORDS)}")
    if "transitions" not in record:
        train_set = set()  # nothing of the steps is kept (an objective that trains on the final sample)
    keep_means = "means" in record
    sigma_list = sigmas.tolist()  # one host read for the whole loop
    # Flow-GRPO evaluates σ/(1−σ) at σ = 1 with the schedule's second sigma instead.
    sigma_max = sigma_list[1] if num_steps > 1 and 0 < sigma_list[1] < 1 else None
    batch = noise.shape[0]
    device = noise.device
    x = noise.to(torch.float32)
    record: dict[str, list[Tensor]] = {k: [] for k in ("x", "x_next", "logp", "mean", "std", "sqrt_dt")}
    forwards = 0
    per_forward = cfg_forwards(policy, guidance_scale)
    rounded = record_dtype != torch.float32
    for j in range(num_steps):
        sigma, sigma_next = sigma_list[j], sigma_list[j + 1]
        if rounded and j in train_set:
            # A trained step starts from a value the record holds exactly (the one the update re-scores).
            x = x.to(record_dtype).float()
        velocity = policy.velocity(x, torch.full((batch,), sigma, device=device), embeds, guidance_scale)
        forwards += per_forward
        stochastic = j in sde_set
        out = sde_step_with_logprob(
            velocity,
            x,
            sigma,
            sigma_next,
            noise_level=noise_level if stochastic else 0.0,
            sde_type=sde_type,
            generator=list(generators) if (stochastic and generators is not None) else None,
            sigma_max=sigma_max,
        )
        if rounded and j in train_set:
            # Keep x_next as stored and score that value (the step math only, no forward): the recorded
            # log-prob is then the one the update recomputes from the record.
            out = sde_step_with_logprob(
                velocity,
                x,
                sigma,
                sigma_next,
                noise_level=noise_level,
                sde_type=sde_type,
                prev_sample=out.prev_sample.to(record_dtype),
                sigma_max=sigma_max,
            )
        if j in train_set:
            record["x"].append(x.to(record_dtype))  # stored as they come: no fp32 copy of all steps
            record["x_next"].append(out.prev_sample.to(record_dtype))
            record["logp"].append(out.log_prob)
            record["std"].append(out.std_dev_t)
            record["sqrt_dt"].append(out.sqrt_dt)
            if keep_means:
                # fp32 whatever record_dtype: the update compares μ_θ with μ_old at the 1e-5 level (Flow-DPPO's
                # δ, GRPO-Guard's re-centring); bf16's rounding of μ alone is a step KL of a few 1e-5.
                record["mean"].append(out.prev_sample_mean)
        x = out.prev_sample
    steps = sorted(train_set)
    empty = torch.zeros(batch, 0, device=device)
    stack = lambda key: torch.stack(record[key], dim=1) if record[key] else empty  # noqa: E731
    return Trajectory(
        latents=stack("x"),
        next_latents=stack("x_next"),
        log_probs=stack("logp"),
        prev_sample_means=stack("mean") if keep_means else None,
        std_dev_t=stack("std"),
        sqrt_dt=stack("sqrt_dt"),
        sigmas=sigmas[steps].cpu(),
        sigmas_next=sigmas[[s + 1 for s in steps]].cpu(),
        step_indices=torch.tensor(steps, dtype=torch.long),
        final=x,
        transformer_forwards=forwards,
        noise_level=noise_level,
        sde_type=sde_type,
        sigma_max=sigma_max,
        schedule=sigmas.cpu(),
    )


def cfg_forwards(policy: FlowPolicy, guidance_scale: float) -> int:
    """Single-sample transformer forwards per sample and step: 2 where CFG runs as one batched
    forward of the conditional and unconditional halves, else 1 (FLUX's distilled guidance)."""
    return 2 if (guidance_scale > 1.0 and policy.uses_cfg_batch) else 1


def per_sample_generators(seeds: Tensor, device: torch.device | str) -> list[torch.Generator]:
    """One generator per sample, seeded from the batch's per-sample seeds."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds.tolist()]


def initial_noise(
    shape: Sequence[int], generators: Sequence[torch.Generator], device: torch.device | str
) -> Tensor:
    """(B, *shape) standard normal fp32 on ``device``, row i drawn from generator i (on its own device)."""
    return torch.stack([torch.randn(tuple(shape), generator=g, device=g.device) for g in generators]).to(
        device
    )


def _device(policy: FlowPolicy) -> torch.device:
    return next(policy.transformer.parameters()).device
