"""`HeldOutReport`: the quickstart's before/after line and picture.

Validation before training runs as Lightning's sanity check (``num_sanity_val_steps: -1``), whose
logged values Lightning discards; this callback keeps its own tally from the validation outputs, so
the base accuracy is known, logged at step 0 (every validation reward component), printed as soon
as it is measured, a line per later validation, and at the end:

    held-out strict accuracy of the base model: 0.412
    held-out strict accuracy after 30 rollouts: 0.498
    held-out strict accuracy: 0.412 -> 0.561 (+0.149 ± 0.016, 1000 paired samples; the base model -> after 60 rollouts)

Every validation samples the same prompts with the same seeds, so the gain is a paired difference:
its standard error is that of the per-sample differences (validation outputs carry ``sample_ids``),
far smaller than the two accuracies' own when most samples keep their verdict.

A run that ends between validations (``max_steps`` not a multiple of ``val_check_interval``) is
evaluated once more after its last rollout, so the last line always compares the base model with
the model training ended with; where it cannot (``evaluate_after_training: false``, validation off, a
resumed run whose checkpoint holds no base value, no rollout run), the line says what was not
evaluated instead of repeating a number.

With a ``proxy`` (the reward component the run trains on, when it is not the tracked one), each
line also gives the proxy's validation mean and its gap to the tracked one, and the gap is logged as
``val-aux/<proxy>_gap/mean@1``: the mean over the validation samples scored by both of
proxy − tracked, per sample. A proxy that rises while the tracked gold score does not opens the gap:
reward hacking, measured (``configs/hacking_proxy.yaml``).

It also writes ``base_vs_tuned.png`` to the run's log dir: the first validation prompts, sampled
with the same seeds by the base model (top row of each pair) and the tuned one (bottom row), each
column under its prompt, each sample framed green where the verifier passes it and red where not. For
conditioned records (editing) a row of each sample's first conditioning image, its source, heads each
pair: source | base | tuned.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any, NamedTuple

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image, ImageDraw, ImageFont

from lit_flowgrpo.run_card import HeldOutGain, ProxyGap


class HeldOutReport(L.Callback):
    """Track a validation reward component from the first validation to the last.

    Args:
        component: the reward component in the validation outputs (``name/component``).
        label: how the printed line names it.
        num_images: how many validation samples go into the base-vs-tuned picture.
        filename: the picture's name inside the run's log dir.
        evaluate_after_training: evaluate the tuned model after the last rollout when the run's
            ``val_check_interval`` would not (one more validation; Lightning's ``trainer.should_stop``,
            as ``EarlyStopping`` uses it). Off: the last line says the tuned model was not evaluated.
        proxy: a reward component (``name`` or ``name/component``) to report beside ``component``,
            with the gap between them (see the module docstring); ``None``: none.
        group_by: a field of the validation records (the data module's ``val_records``) to split
            ``component`` by, each group logged as ``val-aux/<component>/<group>/mean@1`` and the
            groups' base -> tuned values printed at the end (``tag``: the shapes world's prompt
            families); ``None``: no split.
    """

    def __init__(
        self,
        component: str = "shapes/strict",
        label: str = "held-out strict accuracy",
        num_images: int = 16,
        filename: str = "base_vs_tuned.png",
        evaluate_after_training: bool = True,
        proxy: str | None = None,
        group_by: str | None = "tag",
    ) -> None:
        if proxy is not None and proxy == component:
            raise ValueError(
                f"proxy ({proxy!r}) must differ from component ({component!r}): the gap would be 0"
            )
        self.component = component
        self.proxy = proxy
        self.group_by = group_by
        self.group_history: list[tuple[int, dict[str, float]]] = []
        """(rollouts done, {group: value}) per evaluation, when ``group_by`` is set."""
        self.label = label
        self.num_images = num_images
        self.filename = filename
        self.evaluate_after_training = evaluate_after_training
        self.history: list[tuple[int, float]] = []
        """(rollouts done, value) per evaluation, the base model's at 0."""
        self.base: tuple[float, int] | None = None
        """The base model's (value, samples), from the evaluation before any rollout; None if none ran."""
        self.counts: list[int] = []  # samples behind each history entry
        self.rollouts = 0  # training batches done, over the whole run (resumed runs included)
        self.last_line = ""
        self._resumed = False
        self._session_start = 0  # rollouts done before this session (a resumed run's)
        self._sums: dict[str, list[float]] = {}
        self._gap = [0.0, 0.0]  # Σ(proxy − component), samples scored by both, this validation
        self.proxy_history: list[tuple[int, float, float]] = []
        """(rollouts done, proxy mean, gap) per evaluation, when a proxy is set."""
        self._images: list[torch.Tensor] = []
        self._prompts: list[str] = []
        self._passed: list[torch.Tensor] = []
        self._sources: list[torch.Tensor] = []
        self._first: _Samples | None = None
        self._last: _Samples | None = None
        self._ids: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self.base_values: torch.Tensor | None = None
        """The base model's value per validation sample id (NaN where unscored); None without ids."""
        self.last_values: torch.Tensor | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.rollouts += 1
        # The last rollout (max_steps reached): ask Lightning to validate now, as it does for a run
        # stopped early, when no evaluation is due at this rollout anyway (then it runs once).
        if (
            self.evaluate_after_training
            and 0 < trainer.max_steps <= trainer.global_step
            and trainer.enable_validation
        ):
            trainer.should_stop = True

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sums, self._images, self._prompts, self._passed = {}, [], [], []
        self._sources = []
        self._ids, self._values = [], []
        self._gap = [0.0, 0.0]

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not isinstance(outputs, dict) or self.component not in outputs.get("rewards", {}):
            return
        for name, values in outputs["rewards"].items():
            finite = values.float()[torch.isfinite(values.float())]
            total = self._sums.setdefault(name, [0.0, 0.0])
            total[0] += float(finite.sum())
            total[1] += float(finite.numel())
        if outputs.get("sample_ids") is not None:
            self._ids.append(outputs["sample_ids"].detach().long().cpu())
            self._values.append(outputs["rewards"][self.component].detach().double().cpu())
        if self.proxy is not None and self.proxy in outputs["rewards"]:
            gap = outputs["rewards"][self.proxy].double() - outputs["rewards"][self.component].double()
            gap = gap[torch.isfinite(gap)]
            self._gap[0] += float(gap.sum())
            self._gap[1] += float(gap.numel())
        have = sum(len(x) for x in self._images)
        if have < self.num_images:
            take = self.num_images - have
            self._images.append(outputs["images"][:take].detach().cpu())  # the picture is drawn on the host
            self._prompts.extend(outputs["prompts"][:take])
            self._passed.append(outputs["rewards"][self.component][:take].float().cpu() > 0.5)
            # an editing record's source, drawn above its pair
            conditions = getattr(batch, "conditions", None)
            if conditions:
                self._sources.extend(c.images[0].detach().cpu() for c in conditions[:take])

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.component not in self._sums:
            return
        names = sorted(self._sums)
        rows = [self._sums[n] for n in names] + [self._gap]
        totals = torch.tensor(rows, dtype=torch.float64, device=pl_module.device)
        totals = trainer.strategy.reduce(totals, reduce_op="sum")  # (components + 1, 2): Σ, n over ranks
        totals, gap_total = totals[:-1], totals[-1]
        means = {n: float(t[0] / t[1]) for n, t in zip(names, totals, strict=True) if t[1] > 0}
        counts = {n: int(t[1]) for n, t in zip(names, totals, strict=True)}
        gap = float(gap_total[0] / gap_total[1]) if gap_total[1] > 0 else None
        value, n = means[self.component], self.rollouts
        if not self.history or n != self.history[-1][0]:
            self.history.append((n, value))
            self.counts.append(counts[self.component])
        values = self._per_sample(trainer, pl_module)
        if n == 0 and self.base is None:
            self.base = (value, counts[self.component])
            self.base_values = values
        self.last_values = values
        images = _Samples(
            torch.cat(self._images) if self._images else torch.zeros(0, 3, 1, 1),
            list(self._prompts),
            torch.cat(self._passed) if self._passed else torch.zeros(0, dtype=torch.bool),
            tuple(self._sources),
        )
        extra = {}
        if gap is not None and self.proxy in means:
            extra = {self.gap_key: gap}
            if not self.proxy_history or n != self.proxy_history[-1][0]:
                self.proxy_history.append((n, means[self.proxy], gap))
        groups = self._group_means(trainer, values)
        if groups and (not self.group_history or n != self.group_history[-1][0]):
            self.group_history.append((n, groups))
        extra |= {f"val-aux/{self.component}/{g}/mean@1": v for g, v in groups.items()}
        if self._first is None and n == 0:
            self._first = images
            if trainer.sanity_checking:  # Lightning drops what is logged during the sanity check
                self._log_base(trainer, means, extra)
        # Logged in the sanity check too: Lightning passes nothing of it to the loggers (_log_base does),
        # but callback_metrics holds it until the check ends, where the run card reads the base model's.
        if extra:
            for key, logged in extra.items():
                pl_module.log(key, logged, on_step=False, on_epoch=True)
        self._last = images
        when = "of the base model" if n == 0 else f"after {n} rollout{'s' if n != 1 else ''}"
        line = f"{self.label} {when}: {value:.3f}"
        if gap is not None and self.proxy in means:
            line += f"; {self.proxy}: {means[self.proxy]:.3f} (gap {gap:+.3f})"
        self._say(line, trainer)

    @property
    def gap_key(self) -> str:
        """The logged name of the proxy's gap: ``val-aux/<proxy>_gap/mean@1``."""
        return f"val-aux/{self.proxy}_gap/mean@1"

    def _per_sample(self, trainer: L.Trainer, pl_module: L.LightningModule) -> torch.Tensor | None:
        """This validation's value per sample id over all ranks (dense: the ids are 0..N-1)."""
        have = torch.tensor(float(bool(self._ids)), device=pl_module.device)
        if float(trainer.strategy.reduce(have, reduce_op="min")) < 1:
            return None  # outputs without sample ids (on some rank): no paired difference
        ids, values = torch.cat(self._ids), torch.cat(self._values)
        size = torch.tensor(float(ids.max()) + 1 if len(ids) else 0.0, device=pl_module.device)
        size = int(trainer.strategy.reduce(size, reduce_op="max"))
        # (value sum, count) per id, summed over ranks: each id is one rank's, so this gathers
        dense = torch.zeros(2, size, dtype=torch.float64)
        finite = torch.isfinite(values)
        dense[0].index_add_(0, ids[finite], values[finite])
        dense[1].index_add_(0, ids, finite.double())
        dense = trainer.strategy.reduce(dense.to(pl_module.device), reduce_op="sum").cpu()
        return torch.where(dense[1] > 0, dense[0] / dense[1].clamp(min=1), torch.nan)

    def _group_means(self, trainer: L.Trainer, values: torch.Tensor | None) -> dict[str, float]:
        """``component``'s mean per value of the records' ``group_by`` field, over every rank.

        Sample id ``i`` is record ``i % len(records)`` (the prompt data module's order); empty without
        per-sample values, records, or the field.
        """
        records = getattr(trainer.datamodule, "val_records", None) if trainer.datamodule else None
        if self.group_by is None or values is None or not records:
            return {}
        labels = [r.get(self.group_by) for r in records]
        if any(label is None for label in labels):
            return {}
        sums: dict[str, list[float]] = {}
        for i, value in enumerate(values.tolist()):
            if value == value:  # not NaN: scored
                total = sums.setdefault(str(labels[i % len(labels)]), [0.0, 0])
                total[0] += value
                total[1] += 1
        return {g: t[0] / t[1] for g, t in sorted(sums.items())}

    def paired_gain(self) -> tuple[float, float, int] | None:
        """(mean tuned − base, its standard error, samples) over the samples scored in both the base
        and the last validation; None where either has no per-sample values or they differ in size."""
        base, last = self.base_values, self.last_values
        if base is None or last is None or len(base) != len(last):
            return None
        both = torch.isfinite(base) & torch.isfinite(last)
        d = (last - base)[both]
        if len(d) < 2:
            return None
        return float(d.mean()), float(d.std() / len(d) ** 0.5), len(d)

    def held_out_gain(self) -> HeldOutGain | None:
        """The base model's value, the last evaluation's and their paired gain, for the run card
        (:class:`~lit_flowgrpo.run_card.HeldOutSource`); None before an evaluation after training began."""
        if self.base is None or not self.history or self.history[-1][0] == 0:
            return None
        n, tuned = self.history[-1]
        paired = self.paired_gain() or (None, None, None)
        proxy, gap = self.proxy_history, None
        if self.proxy is not None and len(proxy) > 1 and proxy[0][0] == 0 and proxy[-1][0] == n:
            gap = ProxyGap(self.proxy, proxy[0][1], proxy[-1][1], proxy[0][2], proxy[-1][2])
        return HeldOutGain(
            self.component, self.base[0], self.base[1], tuned, self.counts[-1], n, *paired, proxy=gap
        )

    @rank_zero_only
    def _say(self, line: str, trainer: L.Trainer | None = None) -> None:
        bar = trainer.progress_bar_callback if trainer is not None else None
        if bar is not None and bar.is_enabled:
            bar.print(line)  # above the bars, not glued to the end of one
        else:
            print(line, flush=True)

    @rank_zero_only
    def _log_base(self, trainer: L.Trainer, means: dict[str, float], extra: dict[str, float]) -> None:
        reward = trainer.lightning_module.reward  # names the keys as the module's validation does
        values = {reward.validation_keys(name)[0]: value for name, value in means.items()} | extra
        for logger in trainer.loggers:
            logger.log_metrics(values, step=0)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank asks for the folder: ``trainer.log_dir`` broadcasts rank 0's, a collective that
        # rank 0 alone would wait in (or fail in, once the other ranks have left) under DDP.
        folder = trainer.log_dir or trainer.default_root_dir
        self._report(trainer, folder)

    @rank_zero_only
    def _report(self, trainer: L.Trainer, folder: str) -> None:
        """The last line, the proxy's line and the picture (rank 0 only)."""
        self.last_line = self._last_line(trainer)
        print(self.last_line, flush=True)
        proxy = self.proxy_history
        if len(proxy) > 1 and proxy[0][0] == 0 and proxy[-1][0] == self.rollouts:
            print(
                f"{self.proxy}: {proxy[0][1]:.3f} -> {proxy[-1][1]:.3f}, its gap to {self.label}: "
                f"{proxy[0][2]:+.3f} -> {proxy[-1][2]:+.3f} (the base model -> after {self.rollouts} rollouts)",
                flush=True,
            )
        groups = self.group_history
        if len(groups) > 1 and groups[0][0] == 0 and groups[-1][0] == self.rollouts:
            parts = [
                f"{g} {groups[0][1][g]:.2f} -> {v:.2f}" for g, v in groups[-1][1].items() if g in groups[0][1]
            ]
            n = self.rollouts
            after = f"after {n} rollout{'s' if n != 1 else ''}"
            print(f"by {self.group_by} (the base model -> {after}): " + ", ".join(parts), flush=True)
        tuned = self.history[-1] if self.history and self.history[-1][0] == self.rollouts > 0 else None
        if tuned is None or self._first is None or self._last is None or not len(self._first.images):
            return
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, self.filename)
        first, last = self._first, self._last
        sources = first.sources if len(first.sources) == len(first.images) else None
        grid = base_vs_tuned_grid(
            first.images, last.images, first.prompts, first.passed, last.passed, sources=sources
        )
        grid.save(path)
        print(f"{'source, ' if sources else ''}base (top) vs tuned (bottom) samples: {path}")

    def _last_line(self, trainer: L.Trainer) -> str:
        """Base -> tuned where both were evaluated; otherwise what was not, and why."""
        n = self.rollouts
        after = f"after {n} rollout{'s' if n != 1 else ''}"
        tuned = self.history[-1] if self.history and self.history[-1][0] == n > 0 else None
        if self.base is not None and tuned is not None:
            base_n, tuned_n = self.base[1], self.counts[-1]
            samples = f", on {base_n} and {tuned_n} samples" if base_n != tuned_n else ""
            paired = self.paired_gain() if self.history[-1][0] == n else None
            gain = f"{paired[0]:+.3f} ± {paired[1]:.3f}, {paired[2]} paired samples; " if paired else ""
            return f"{self.label}: {self.base[0]:.3f} -> {tuned[1]:.3f} ({gain}the base model -> {after}{samples})"
        if self.base is not None:
            base = f"{self.label} of the base model: {self.base[0]:.3f}"
        elif self._resumed:
            base = (
                f"{self.label} of the base model: not known (the checkpoint this run resumed from holds none)"
            )
        else:
            base = (
                f"{self.label} of the base model: not evaluated (no validation before training; "
                "--trainer.num_sanity_val_steps=-1 runs one)"
            )
        if tuned is not None:
            return f"{base}; {after}: {tuned[1]:.3f}"
        if n == 0:
            why = "no rollout ran"
        elif n == self._session_start:
            why = (
                f"no rollout ran in this session: the checkpoint already had {n} rollouts "
                "(raise --trainer.max_steps to train on), and the model was not evaluated after them"
            )
        elif not self.evaluate_after_training:
            why = (
                f"the tuned model ({after}) was not evaluated: HeldOutReport's evaluate_after_training is off"
            )
        elif not trainer.enable_validation:
            why = f"the tuned model ({after}) was not evaluated: validation is off"
        else:
            why = f"the tuned model ({after}) was not evaluated"
        earlier = [h for h in self.history if 0 < h[0] < n]
        if earlier:
            m, value = earlier[-1]
            why += f"; the last evaluation, after {m} rollout{'s' if m != 1 else ''}: {value:.3f}"
        return f"{base}; {why}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "counts": list(self.counts),
            "base": self.base,
            "base_values": self.base_values,
            "rollouts": self.rollouts,
            "proxy_history": list(self.proxy_history),
            "group_history": list(self.group_history),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # checkpoints from before "base" was kept have no base value: the last line says so rather than
        # taking the first history entry, which need not be the base model's
        self._resumed = True
        self.history = [tuple(x) for x in state_dict.get("history", [])] if "base" in state_dict else []
        self.counts = list(state_dict.get("counts", [0] * len(self.history)))
        base = state_dict.get("base")
        self.base = None if base is None else (float(base[0]), int(base[1]))
        self.base_values = state_dict.get("base_values")
        self.rollouts = int(state_dict.get("rollouts", 0))
        self.proxy_history = [tuple(x) for x in state_dict.get("proxy_history", [])]
        self.group_history = [(int(n), dict(g)) for n, g in state_dict.get("group_history", [])]
        self._session_start = self.rollouts  # the rollouts done before this session


def base_vs_tuned_grid(
    base: torch.Tensor,
    tuned: torch.Tensor,
    prompts: list[str] | None = None,
    base_passed: torch.Tensor | None = None,
    tuned_passed: torch.Tensor | None = None,
    per_row: int = 8,
    scale: int = 4,
    sources: list[torch.Tensor] | None = None,
) -> Image.Image:
    """Pairs of rows: base samples above the tuned samples of the same prompts and seeds.

    With ``sources`` (one (3, H, W) image per sample, an edit's source) each pair is headed by a row of
    them, unframed: source | base | tuned.

    Each column is headed by its prompt (wrapped); a sample whose pass flag is given gets a green
    frame (the verifier passes it) or a red one (it fails). Videos (B, F, 3, H, W) are drawn as film
    strips, their frames left to right.
    """
    base, tuned = _film_strips(base), _film_strips(tuned)
    if base.ndim == 4 and base.shape[-1] > 4 * base.shape[-2]:
        per_row = min(per_row, 4)  # strips are wide: fewer per row keeps the picture readable
    n = min(len(base), len(tuned))
    _, _, h, w = base.shape
    font = ImageFont.load_default()
    tile_w, tile_h = w * scale, h * scale
    frame, pad, label_w = 3, 6, 44
    chars = max(8, tile_w // 6)  # the default bitmap font is about 6 px a character
    captions = [textwrap.wrap(p, chars)[:4] for p in (prompts or [])[:n]]
    text_h = 11 * max((len(c) for c in captions), default=0)
    cell_w = tile_w + 2 * frame + pad
    rows_of = ("source", "base", "tuned") if sources is not None else ("base", "tuned")
    cell_h = text_h + len(rows_of) * (tile_h + 2 * frame) + 2 * pad
    rows, cols = (n + per_row - 1) // per_row, max(1, min(n, per_row))
    legend_h = 16 if base_passed is not None or tuned_passed is not None else 0
    canvas = Image.new("RGB", (label_w + cols * cell_w + pad, rows * cell_h + pad + legend_h), (30, 30, 30))
    draw = ImageDraw.Draw(canvas)
    colours = {True: (40, 200, 70), False: (220, 50, 50)}
    for r in range(rows):
        y0 = pad + r * cell_h + text_h
        for k, name in enumerate(rows_of):
            draw.text((4, y0 + k * (tile_h + 2 * frame) + tile_h // 2), name, fill=(200, 200, 200), font=font)
    for i in range(n):
        r, c = divmod(i, per_row)
        x0, y0 = label_w + pad + c * cell_w, pad + r * cell_h
        for line_no, line in enumerate(captions[i] if i < len(captions) else []):
            draw.text((x0, y0 + 11 * line_no), line, fill=(230, 230, 230), font=font)
        tiles = [(base[i], base_passed), (tuned[i], tuned_passed)]
        if sources is not None:
            tiles.insert(0, (sources[i], None))
        for k, (sample, passed) in enumerate(tiles):
            top = y0 + text_h + k * (tile_h + 2 * frame)
            if passed is not None and i < len(passed):
                draw.rectangle(
                    [x0, top, x0 + tile_w + 2 * frame - 1, top + tile_h + 2 * frame - 1],
                    fill=colours[bool(passed[i])],
                )
            pixels = (sample.clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
            tile = Image.fromarray(pixels).resize((tile_w, tile_h), Image.NEAREST)
            canvas.paste(tile, (x0 + frame, top + frame))
    if legend_h:
        draw.text(
            (label_w + pad, rows * cell_h + pad),
            "frame: green = the verifier passes the sample, red = it fails",
            fill=(200, 200, 200),
            font=font,
        )
    return canvas


def _film_strips(samples: torch.Tensor) -> torch.Tensor:
    """Videos (B, F, 3, H, W) as images (B, 3, H, F·W), frames left to right; images unchanged."""
    if samples.ndim != 5:
        return samples
    b, f, c, h, w = samples.shape
    return samples.permute(0, 2, 3, 1, 4).reshape(b, c, h, f * w)


class _Samples(NamedTuple):
    images: torch.Tensor
    prompts: list[str]
    passed: torch.Tensor
    sources: tuple[torch.Tensor, ...] = ()
