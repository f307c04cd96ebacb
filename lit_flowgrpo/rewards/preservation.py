"""``preservation``: how much of its source an edit kept, outside the region the instruction names.

An edit should change what the instruction asks for and nothing else. This term compares the result with
the record's source image (its ``source_index``-th conditioning image, the first by default: the image
being edited) over the pixels that the edit was allowed to leave alone:

- ``pixel`` = 1 − mean over the kept pixels and the 3 channels of |result − source|, in [0, 1] (1: the
  kept region is unchanged);
- ``ssim`` = the mean over the kept pixels of the SSIM map (Wang et al., 2004; torchmetrics'
  ``structural_similarity_index_measure``: an 11 × 11 Gaussian window of σ 1.5, data range 1, K = (0.01,
  0.03), reflect-padded, averaged over the channels), in [−1, 1]. A window reaching into the edited
  region sees the edit, so here the kept region also drops the pixels within the window's radius (5) of
  it, unless that leaves none;
- ``feature`` (when ``model`` is set): the cosine similarity, in [−1, 1], of the two images' embeddings
  by a vision model loaded with transformers' ``from_pretrained`` (a CLIP or SigLIP model through its
  ``get_image_features``, as Flow-GRPO's FLUX.1 Kontext counting task keeps the edit consistent with
  CLIP image similarity; a DINOv2 or ViT tower through its ``pooler_output``, the DINO score of subject
  fidelity). The edited region of the result is filled with the source's own pixels first, so the two
  images differ only where the edit was not allowed to change anything.

**The edited region** comes from the record's metadata: ``"edit_mask"``, an image path (white, ≥ 128 in
grey, marks the edited pixels; drawn at any size, resized to the result's by nearest neighbour; a relative
path is read from ``mask_root``), and/or ``"edit_box"``, ``[x0, y0, x1, y1]`` or a list of such boxes in
the source image's pixels (x to the right, y down, x1 and y1 exclusive; scaled to the result, every pixel
the box touches excluded). Both together exclude their union. Without either, the whole image is compared.
A sample whose edited region covers the whole image has nothing to compare: NaN in every component.

**Sizes.** A source at the result's size is compared as it is. One of another size is resized to the
result's, as the editing pipelines resize their input image to the output size: diffusers'
``VaeImageProcessor.resize`` of the PIL image (Lanczos, the processor's default), which is what
``FluxKontextPipeline`` and ``QwenImageEditPlusPipeline`` do to a PIL source. A source of another aspect
ratio is therefore stretched, as the pipelines stretch it; a box is scaled with it.

``pixel`` and ``ssim`` are computed in float64 on the images' device and returned in float32, so an
unchanged kept region scores 1 to within one float32 rounding.
"""

from __future__ import annotations

import math
import numbers
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.policies.base import DType
from lit_flowgrpo.rewards.edit import checked_sources, to_pil_one
from lit_flowgrpo.rewards.hf import as_features, check_dtype, place
from lit_flowgrpo.rewards.images import check_images, to_pil
from lit_flowgrpo.rewards.registry import register_reward

__all__ = ["BOX_KEY", "MASK_KEY", "PreservationReward", "edited_region", "resized_source"]

_FLAG = "--model.init_args.reward.init_args.config.preservation"

#: The metadata field naming an image of the edited region.
MASK_KEY = "edit_mask"
#: The metadata field giving the edited region as box(es) in the source's pixels.
BOX_KEY = "edit_box"
#: Mask images kept decoded (least recently used dropped): a group's K samples share their record's.
_MASKS_KEPT = 256
#: Half the SSIM window (11 × 11): how far the edit reaches into a kept pixel's window.
_SSIM_RADIUS = 5


def resized_source(source: Tensor, height: int, width: int) -> Tensor:
    """(3, height, width) fp32: ``source`` (3, h, w) as it is when it has that size, else resized as the
    editing pipelines resize their input image (diffusers' ``VaeImageProcessor.resize`` of the PIL image:
    Lanczos)."""
    if tuple(source.shape[1:]) == (height, width):
        return source
    from diffusers.image_processor import VaeImageProcessor

    pil = VaeImageProcessor().resize(to_pil_one(source), height, width)
    pixels = torch.from_numpy(np.asarray(pil, dtype=np.uint8).copy())  # (H, W, 3) uint8
    return pixels.permute(2, 0, 1).float().div(255.0).to(source.device)


def _boxes(value: Any) -> list[tuple[float, float, float, float]] | str:
    """The boxes of an ``edit_box`` field, or why it is not one."""
    if isinstance(value, Sequence) and value and all(isinstance(v, Sequence) for v in value):
        boxes = list(value)
    else:
        boxes = [value]
    out = []
    for box in boxes:
        if not (
            isinstance(box, Sequence)
            and len(box) == 4
            and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in box)
        ):
            return f"{box!r} is not [x0, y0, x1, y1] (four numbers)"
        x0, y0, x1, y1 = (float(v) for v in box)
        if not (0 <= x0 < x1 and 0 <= y0 < y1):
            return f"{box!r} needs 0 <= x0 < x1 and 0 <= y0 < y1 (pixels of the source, x1 and y1 exclusive)"
        out.append((x0, y0, x1, y1))
    return out


def edited_region(
    boxes: Sequence[tuple[float, float, float, float]],
    mask: Image.Image | None,
    source_size: tuple[int, int],
    height: int,
    width: int,
) -> Tensor:
    """(height, width) bool: the result's pixels the edit may change, from ``mask`` (an ``L`` image, ≥ 128
    edited, resized by nearest neighbour) and ``boxes`` (in the pixels of a source of ``source_size`` =
    (width, height), scaled to the result; every pixel a box touches is edited)."""
    edited = torch.zeros(height, width, dtype=torch.bool)
    if mask is not None:
        resized = mask.resize((width, height), Image.NEAREST)
        edited |= torch.from_numpy(np.asarray(resized, dtype=np.uint8) >= 128)
    sx, sy = width / source_size[0], height / source_size[1]
    for x0, y0, x1, y1 in boxes:
        c0, c1 = max(0, math.floor(x0 * sx)), min(width, math.ceil(x1 * sx))
        r0, r1 = max(0, math.floor(y0 * sy)), min(height, math.ceil(y1 * sy))
        edited[r0:r1, c0:c1] = True
    return edited


@register_reward("preservation")
class PreservationReward:
    """How much of the source each edit kept outside its edited region (see the module doc).

    Components: ``pixel`` (1 − mean |result − source|), ``ssim`` (mean SSIM) and, when ``model`` is set,
    ``feature`` (the cosine of the two images' embeddings).

    Args:
        primary: the component a bare ``preservation`` weight applies to.
        model: a vision model for ``feature``: a hub id or a local ``save_pretrained`` folder that
            ``AutoModel`` and ``AutoImageProcessor`` load (CLIP, SigLIP, DINOv2, ViT); ``None`` computes
            no ``feature``.
        device: where the comparison and the model run; ``None`` follows the images.
        dtype: the model's weights dtype.
        source_index: which of the record's conditioning images is the source the result is compared
            with (0: the first, the image being edited).
        mask_root: the folder a relative ``edit_mask`` path is read from; ``None`` reads it from the
            working directory.
    """

    uses_sources = True
    needs_sources = True

    def __init__(
        self,
        primary: Literal["pixel", "ssim", "feature"] = "pixel",
        model: str | None = None,
        device: str | None = None,
        dtype: DType = "float32",
        source_index: int = 0,
        mask_root: str | None = None,
    ) -> None:
        check_dtype(dtype, _FLAG)
        problems = []
        if primary not in ("pixel", "ssim", "feature"):
            problems.append(f"{_FLAG}.primary ({primary!r}) must be 'pixel', 'ssim' or 'feature'")
        if primary == "feature" and model is None:
            problems.append(
                f"{_FLAG}.primary is 'feature' but {_FLAG}.model is null: name a vision model (e.g. "
                "facebook/dinov2-base), or weight 'pixel' or 'ssim'"
            )
        if not isinstance(source_index, int) or source_index < 0:
            problems.append(f"{_FLAG}.source_index ({source_index!r}) must be 0 or more")
        if mask_root is not None and not os.path.isdir(os.path.expanduser(mask_root)):
            problems.append(f"{_FLAG}.mask_root ({mask_root!r}) is not a folder")
        if problems:
            raise SettingsError("; ".join(problems))
        self.primary = primary
        self.model_name = model
        self.device = device
        self.dtype = dtype
        self.source_index = source_index
        self.mask_root = None if mask_root is None else os.path.expanduser(mask_root)
        self.model: torch.nn.Module | None = None
        self.processor: Any = None
        self._masks: OrderedDict[str, Image.Image] = OrderedDict()

    def load(self) -> None:
        """Read the feature model's weights (``from_pretrained``); called on first use."""
        if self.model is not None or self.model_name is None:
            return
        from transformers import AutoImageProcessor, AutoModel

        self.processor = AutoImageProcessor.from_pretrained(self.model_name)
        self.model = AutoModel.from_pretrained(self.model_name).eval().requires_grad_(False)

    def _mask_path(self, path: str) -> str:
        path = os.path.expanduser(path)
        return path if os.path.isabs(path) or self.mask_root is None else os.path.join(self.mask_root, path)

    def problems(self, records: Sequence[Mapping[str, Any]]) -> list[str]:
        """One message per record whose ``edit_mask`` cannot be read, whose ``edit_box`` is malformed, or
        which gives fewer conditioning images than ``source_index`` needs."""
        out = []
        for n, record in enumerate(records):
            where = f"record {n + 1}"
            if MASK_KEY in record:
                given = record[MASK_KEY]
                found = (
                    self._mask_problem(given)
                    if isinstance(given, str) and given
                    else f"{given!r} is not a path"
                )
                if found is not None:
                    out.append(f"{where}: {MASK_KEY} {found}")
            if BOX_KEY in record:
                boxes = _boxes(record[BOX_KEY])
                if isinstance(boxes, str):
                    out.append(f"{where}: {BOX_KEY} {boxes}")
            images = record.get("condition_images") or ()
            count = 1 if isinstance(images, str) else len(images)
            if count and count <= self.source_index:
                out.append(
                    f"{where} gives {count} condition_images, but {_FLAG}.source_index ({self.source_index}) "
                    f"compares with image {self.source_index + 1}: lower source_index"
                )
        return out

    def _mask_problem(self, given: str) -> str | None:
        """Why the mask image ``given`` names cannot be read (its header), or ``None``."""
        path = self._mask_path(given)
        where = "the working directory" if self.mask_root is None else f"{_FLAG}.mask_root ({self.mask_root})"
        if not os.path.isfile(path):
            return f"{path!r} does not exist (a relative path is read from {where})"
        try:
            with Image.open(path):
                return None
        except OSError as err:
            return f"{path!r} cannot be read ({type(err).__name__}: {err})"

    def _mask(self, given: str) -> Image.Image:
        """The mask image ``given`` names, as a grey ``L`` image; the last ``_MASKS_KEPT`` stay decoded."""
        path = self._mask_path(given)
        if path in self._masks:
            self._masks.move_to_end(path)
            return self._masks[path]
        problem = self._mask_problem(given)
        if problem is not None:
            raise ValueError(f"preservation: {MASK_KEY} {problem}")
        with Image.open(path) as opened:
            mask = self._masks[path] = opened.convert("L")
        while len(self._masks) > _MASKS_KEPT:
            self._masks.popitem(last=False)
        return mask

    def _edited(
        self, meta: Mapping[str, Any], source_size: tuple[int, int], height: int, width: int
    ) -> Tensor:
        mask = self._mask(str(meta[MASK_KEY])) if MASK_KEY in meta else None
        boxes = _boxes(meta[BOX_KEY]) if BOX_KEY in meta else []
        if isinstance(boxes, str):
            raise ValueError(f"preservation: {BOX_KEY} {boxes}")
        return edited_region(boxes, mask, source_size, height, width)

    @torch.no_grad()
    def __call__(
        self,
        images: Tensor,
        prompts: list[str],
        metadata: list[dict],
        sources: Sequence[Sequence[Tensor]] | None = None,
    ) -> dict[str, Tensor]:
        """``{component: (B,) fp32}`` for (B, 3, H, W) results; NaN in every component where the edited
        region leaves nothing to compare."""
        from torchmetrics.functional.image import structural_similarity_index_measure

        check_images(images)
        batch, _, height, width = images.shape
        if min(height, width) <= _SSIM_RADIUS:
            raise ValueError(
                f"preservation: SSIM needs images larger than {_SSIM_RADIUS} pixels a side, got {height}x{width}"
            )
        given = checked_sources(sources, batch, f"reward 'preservation' ({_FLAG})")
        metadata = list(metadata) if metadata else [{}] * batch
        device = torch.device(self.device) if self.device else images.device
        pixel, ssim = torch.full((batch,), math.nan), torch.full((batch,), math.nan)
        references, filled, scorable = [], [], []
        for i in range(batch):
            if len(given[i]) <= self.source_index:
                raise ValueError(
                    f"preservation: sample {i} has {len(given[i])} source image(s); {_FLAG}.source_index is "
                    f"{self.source_index}"
                )
            original = given[i][self.source_index]
            source = resized_source(original, height, width).to(device, torch.float64)  # (3, H, W)
            result = images[i].to(device, torch.float64)  # (3, H, W)
            size = (original.shape[2], original.shape[1])
            edited = self._edited(metadata[i], size, height, width).to(device)  # (H, W) bool
            kept = ~edited
            if self.model_name is not None:  # the result with the edit's own region filled from the source
                references.append(source)
                filled.append(torch.where(edited, source, result))
            scorable.append(bool(kept.any()))
            if not scorable[-1]:
                continue
            pixel[i] = float(1 - (result - source).abs().mean(0)[kept].mean())
            _, full = structural_similarity_index_measure(
                result[None], source[None], data_range=1.0, return_full_image=True, reduction="none"
            )  # full: (1, 3, H, W) float64
            window = 2 * _SSIM_RADIUS + 1
            near = F.max_pool2d(edited[None, None].double(), window, stride=1, padding=_SSIM_RADIUS)[0, 0] > 0
            far = ~near if (~near).any() else kept  # windows that never see the edit, if any are left
            ssim[i] = float(full[0].mean(0)[far].mean())
        out = {"pixel": pixel, "ssim": ssim}
        if self.model_name is not None:
            out["feature"] = self._feature(torch.stack(filled), torch.stack(references), device)
        unscorable = torch.tensor([not s for s in scorable])
        for value in out.values():  # nothing to compare: NaN in every component, never a number
            value[unscorable] = math.nan
        return out

    def _feature(self, results: Tensor, sources: Tensor, device: torch.device) -> Tensor:
        """(B,) fp32: cos(E(result), E(source)) of the vision model's embeddings."""
        self.load()
        model = place(self.model, device, self.dtype)
        dtype = next(model.parameters()).dtype
        pixels = self.processor(images=to_pil(torch.cat([results, sources]).float()), return_tensors="pt")
        values = pixels["pixel_values"].to(device, dtype)
        if hasattr(model, "get_image_features"):
            embeds = as_features(model.get_image_features(pixel_values=values))
        else:
            embeds = getattr(model(pixel_values=values), "pooler_output", None)
            if not isinstance(embeds, Tensor):
                raise SettingsError(
                    f"{_FLAG}.model ({self.model_name}) has neither get_image_features nor a pooler_output: "
                    "give a CLIP or SigLIP model, or a vision tower with a pooler (DINOv2, ViT)"
                )
        embeds = embeds.double()  # (2B, D) float64
        ours, theirs = embeds.chunk(2)
        return F.cosine_similarity(ours, theirs, dim=-1).float().cpu()
