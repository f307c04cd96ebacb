"""The one small interface every model family implements.

A policy owns the networks of one model family (text encoders, the denoising transformer, the
VAE) and exposes exactly what the RL loop needs. The loop never looks inside: latents may be
(C, h, w) images or packed (seq, C) tokens, the text conditioning may be one tensor or several;
the loop only indexes them along the batch dimension.

Lifecycle: the constructor only records and checks settings (cheap, so a bad config fails before
any weight is read); :meth:`load` reads the weights. ``FlowGRPOModule.configure_model`` calls it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import pkgutil
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from typing import Any, Literal

import torch
from packaging.version import Version
from torch import Tensor, nn

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.conditioning import Condition

Embeds = dict[str, Tensor]
"""Prompt conditioning: every tensor is batch-first, one row per prompt."""

DType = Literal["float32", "bfloat16", "float16"]

Modality = Literal["image", "video"]
"""What a policy's :meth:`FlowPolicy.decode` returns: ``"image"`` (B, 3, H, W) or ``"video"`` (B, F, 3, H, W)."""

#: The attention projections of an MMDiT joint block (SD3, FLUX): image stream and text stream.
MMDIT_ATTENTION_PROJECTIONS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)

#: The sampler settings an image size comes from; :meth:`FlowPolicy.image_size_problems` names them.
HEIGHT_FLAG = "--model.init_args.sampler.height"
WIDTH_FLAG = "--model.init_args.sampler.width"
FRAMES_FLAG = "--model.init_args.sampler.frames"
#: The settings of a conditioning image's output size, which a message about that size names: the rollout's
#: (the training set's) and validation's (the validation set's), since it is asked for both.
OUTPUT_SIZE_FLAGS = (
    f"{HEIGHT_FLAG}, {WIDTH_FLAG}; validation: --model.init_args.sampler.eval_height, "
    "--model.init_args.sampler.eval_width"
)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")
# Where lit_flowgrpo.tiny's builders put their pipelines by default (`python -m lit_flowgrpo.tiny.<family>`
# writes `.tiny_models/<family>`); which names are families is read from that package's modules.
_TINY_FOLDER = re.compile(r"(?:^|/)\.tiny_models/(\w+)/?$")
#: The modules of lit_flowgrpo.tiny that build no pipeline.
_TINY_HELPERS = frozenset({"specs", "tokenizers"})


def _tiny_builder(name: str) -> bool:
    """Whether ``lit_flowgrpo.tiny.<name>`` builds a tiny pipeline, found without importing that package
    (``find_spec`` of a subpackage imports its parent only)."""
    spec = importlib.util.find_spec("lit_flowgrpo.tiny")
    if spec is None or spec.submodule_search_locations is None or name in _TINY_HELPERS:
        return False
    return name in {m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)}


def resolve_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def pretrained_dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword that makes the installed diffusers' ``from_pretrained`` load in ``dtype``.

    diffusers 0.40 renamed ``torch_dtype`` to ``dtype`` (the old name still works there, with a
    deprecation warning); releases before 0.40 ignore an unknown ``dtype=`` without a word and load
    fp32. So the name follows the installed version.
    """
    if Version(version("diffusers")).release >= (0, 40):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}


def load_pipeline(policy: FlowPolicy, dtype: torch.dtype | dict[str, torch.dtype], flag: str) -> Any:
    """``policy.pipeline_class.from_pretrained(policy.pretrained)`` in ``dtype`` (one dtype, or diffusers'
    ``{component: dtype}`` mapping with a ``"default"``), a failed read raised as a ``ValueError`` that
    names ``flag``."""
    (key,) = pretrained_dtype_kwargs(torch.float32)  # the keyword's name, which follows diffusers' version
    try:
        return policy.pipeline_class.from_pretrained(policy.pretrained, **{key: dtype})
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{flag} ({policy.pretrained}): loading the {policy.pipeline_name} failed: {err}"
        ) from err


def causal_video_frame_problems(frames: int, flag: str, policy: str, vae: str, factor: int) -> list[str]:
    """Problems with a frame count for a causal video VAE (``vae``, for the message) that encodes the first
    frame alone and then every ``factor``: ``frames`` must be ``factor``·k + 1."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        return [f"{flag} ({frames!r}) must be a positive whole number of frames"]
    if frames % factor != 1:
        nearest = (frames // factor) * factor + 1
        return [
            f"{flag} ({frames}) must be 4k + 1 for {policy} ({vae} encodes the first frame "
            f"alone and then every {factor}): use {nearest}, for example"
        ]
    return []


def check_pretrained(pretrained: str, flag: str) -> list[str]:
    """Problems with a ``pretrained`` setting, checked before loading.

    A local path must exist and hold a ``model_index.json`` (a diffusers pipeline folder); anything
    that is not a local path must look like a hub id (``org/name``).
    """
    if os.path.isdir(pretrained):
        if not os.path.isfile(os.path.join(pretrained, "model_index.json")):
            return [
                f"{flag} ({pretrained}) is a folder without model_index.json: point it at a diffusers "
                "pipeline folder (the one `save_pretrained` writes) or a hub id"
            ]
        return []
    if os.path.sep in pretrained.rstrip("/").lstrip("./") and pretrained.startswith((".", "/", "~")):
        # configs/tiny_sd3.yaml on a fresh clone: the tiny pipeline is built, never shipped
        tiny = _TINY_FOLDER.search(pretrained)
        if tiny and _tiny_builder(tiny.group(1)):
            return [
                f"{flag} ({pretrained}) does not exist: build the tiny random {tiny.group(1)} pipeline there "
                f"first with `python -m lit_flowgrpo.tiny.{tiny.group(1)} {pretrained}`"
            ]
        return [f"{flag} ({pretrained}) does not exist: give an existing local pipeline folder or a hub id"]
    if not _HUB_ID.match(pretrained):
        return [
            f"{flag} ({pretrained}) is neither an existing folder nor a hub id like "
            "'stabilityai/stable-diffusion-3.5-medium'"
        ]
    return []


def check_family(pretrained: str, expected: Sequence[str], flag: str, policy: str) -> list[str]:
    """For a local folder, check that ``model_index.json`` names one of the ``expected`` pipelines.

    Read before any weight is loaded, so SD3 weights handed to a FLUX policy fail at once.
    """
    index = os.path.join(pretrained, "model_index.json")
    if not os.path.isfile(index):
        return []  # a hub id: checked by from_pretrained itself
    try:
        with open(index, encoding="utf-8") as f:
            name = json.load(f).get("_class_name")
    except (OSError, json.JSONDecodeError) as e:
        return [f"{flag} ({pretrained}): model_index.json is unreadable ({e}); re-save the pipeline"]
    if name not in expected:
        return [
            f"{flag} ({pretrained}) holds a {name}, but {policy} needs one of {list(expected)}: "
            "choose the policy class that matches the weights"
        ]
    return []


def index_embeds(embeds: Embeds, index: Tensor | slice | Sequence[int]) -> Embeds:
    """Rows ``index`` of every conditioning tensor."""
    if not isinstance(index, (Tensor, slice)):
        index = torch.as_tensor(index, dtype=torch.long)
    return {k: v[index] for k, v in embeds.items()}


def cat_embeds(parts: Sequence[Embeds]) -> Embeds:
    """Concatenate conditioning along the batch dimension (keys must agree)."""
    keys = parts[0].keys()
    return {k: torch.cat([p[k] for p in parts], dim=0) for k in keys}


def embeds_to(embeds: Embeds, device: torch.device | str) -> Embeds:
    return {k: v.to(device) for k, v in embeds.items()}


class PromptCache(OrderedDict[str, Embeds]):
    """Each prompt's conditioning (batch dimension 1), encoded alone and kept; past ``size`` prompts
    the least recently used is dropped (``size`` 0 keeps none between calls).

    Alone, not in the batch it first arrives with: an encoder's batched kernels round differently
    with the batch size (4.8e-7 seen on a CPU for SD3's pooled CLIP output), so batch encoding would
    make a prompt's conditioning depend on which prompts shared its first batch, that is, on the
    run's history. A resumed run, whose cache starts empty, would then drift from an uninterrupted
    one. Encoded alone, a prompt's rows are a function of the prompt: the cache changes speed only.
    """

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def __reduce__(self) -> tuple[Any, ...]:
        # A spawned DDP worker receives the module pickled; OrderedDict's own reduce would rebuild
        # this without its size.
        return type(self), (self.size,), None, None, iter(self.items())

    def rows(self, prompts: Sequence[str], encode_one: Callable[[str], Embeds]) -> list[Embeds]:
        """One conditioning dict per prompt (repeats share rows), encoding each missing prompt once."""
        found: dict[str, Embeds] = {}
        for prompt in dict.fromkeys(prompts):
            if prompt in self:
                self.move_to_end(prompt)
                found[prompt] = self[prompt]
            else:
                found[prompt] = self[prompt] = encode_one(prompt)
        while len(self) > self.size:
            self.popitem(last=False)
        return [found[p] for p in prompts]


_DIFFUSERS_T5_NOTICE = "The following part of your input was truncated because `max_sequence_length`"


class T5Truncation:
    """Warns once per run that prompts are longer than ``max_sequence_length`` T5 tokens, naming the
    flag, in place of the notice the SD3 and FLUX pipelines print on every encoding call.

    That notice lists, for each prompt of the batch, the tokens from position 76 on (CLIP's limit,
    not the T5 limit in force), so a batch that holds one long prompt printed ``['', '', '']``: one
    empty "truncated part" per prompt, negative prompts included.
    """

    def __init__(self, max_sequence_length: int) -> None:
        self.max_sequence_length = max_sequence_length
        self.count = 0  # prompts truncated so far

    @contextmanager
    def encoding(self, pipe: Any, tokenizer: Any, prompt: str) -> Iterator[None]:
        """Encode ``prompt`` with ``pipe`` inside this block: its truncation is reported here."""
        n = len(tokenizer(prompt).input_ids) if tokenizer is not None else 0
        if n > self.max_sequence_length:
            self.count += 1
            if self.count == 1:
                from lightning.pytorch.utilities import rank_zero_warn

                rank_zero_warn(
                    f"prompt {prompt[:60]!r}{'...' if len(prompt) > 60 else ''} has {n} T5 tokens; "
                    f"--model.init_args.policy.init_args.max_sequence_length ({self.max_sequence_length}) keeps the "
                    f"first {self.max_sequence_length} (reported for the first such prompt only)"
                )
        quiet = _DropMessages(_DIFFUSERS_T5_NOTICE)
        logger = logging.getLogger(type(pipe).__module__)  # diffusers' per-module logger
        logger.addFilter(quiet)
        try:
            yield
        finally:
            logger.removeFilter(quiet)


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


class FlowPolicy(nn.Module, ABC):
    """A flow-matching text-to-image model family as the RL loop sees it.

    Conventions (DESIGN.md): x_σ = (1−σ)·x0 + σ·ε, velocity v = ε − x0, σ runs from 1 to 0.
    """

    #: The weights :meth:`load` reads: a hub id or a local folder (what a run card names as the base
    #: model); ``None`` for a policy that names none.
    pretrained: str | None = None
    #: peft ``target_modules`` used when the user does not name any.
    default_lora_targets: tuple[str, ...] = ()
    #: Classifier-free guidance in the rollout doubles the transformer batch for this family.
    uses_cfg_batch: bool = True
    #: Image height and width must be multiples of this for the family's released checkpoints
    #: (VAE downsampling × patch size), known without reading any config.
    image_size_multiple: int = 1
    #: Why: completes "... must be a positive multiple of N for <policy>: ...".
    image_size_reason: str = ""
    #: ``"image"``: :meth:`decode` returns (B, 3, H, W) and :meth:`latent_shape` takes (height, width);
    #: ``"video"``: (B, F, 3, H, W), and :meth:`latent_shape` takes (height, width, frames) too.
    modality: Modality = "image"
    #: The dtype the transformer's matrix products run in, set by whoever sets that up
    #: (``FlowGRPOModule.configure_model``, from ``performance.compute_dtype``); ``None``: each network's
    #: own dtype. :meth:`input_dtype` feeds the inputs in it.
    compute_dtype: torch.dtype | None = None
    #: LoRA rank when ``--model.init_args.weights.lora.rank`` is not given.
    default_lora_rank: int = 32
    #: LoRA alpha when ``--model.init_args.weights.lora.alpha`` is not given; ``None``: twice the rank in force.
    default_lora_alpha: int | None = None
    #: Where the LoRA export writes the adapters of ``trainable_networks[1:]`` (the first goes to the
    #: export folder itself); one name per network after the first.
    lora_subfolders: tuple[str, ...] = ()
    #: Whether prompts of different lengths are padded and the padding masked in attention (the
    #: attention kernel is chosen for it).
    masked_prompts: bool = False
    #: The latent decoder (a diffusers VAE), registered as a submodule by :meth:`load`; ``None`` for a
    #: family without one (it decodes in pixel space) or before loading.
    vae: nn.Module | None
    #: How many conditioning images a record gives this family, (fewest, most): (0, 0) for text only;
    #: an editing family (1, 1) or more, image-to-video (1, 1). Checked against the records before load
    #: (:func:`lit_flowgrpo.conditioning.condition_problems`).
    condition_images: tuple[int, int] = (0, 0)
    #: What the messages call one conditioning image ("source image", "first frame").
    condition_name: str = "conditioning image"
    #: Every record of a prompt set must give the same number of conditioning images: the family joins the
    #: sources' tokens to each sample's sequence, and one batch has one sequence length (Qwen-Image-Edit).
    condition_counts_agree: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.vae = None  # a later `self.vae = module` registers the module in its place (nn.Module)

    def input_dtype(self, network: nn.Module) -> torch.dtype:
        """The dtype ``network``'s inputs (latents, timestep, conditioning) are fed in: the compute dtype
        where it is a reduced precision, else the network's own dtype.

        A full fine-tune's float32 master weights compute in the model's dtype under autocast, beside
        frozen copies (the KL reference, the old policy) that hold that dtype: fed each network's own
        dtype, the masters would see float32 inputs and the copies bf16 ones, and an input that meets an
        operation autocast leaves alone (FLUX's timestep scaled by 1000, Qwen-Image's RMS norm of the
        prompt) would round differently in the two, so the first update's KL to the reference would not
        be exactly 0. In the compute dtype every network sees the same tensors, as the family's pipeline
        feeds its model (the timestep in the model's dtype)."""
        dtype = self.compute_dtype
        return network.dtype if dtype is None or dtype == torch.float32 else dtype

    @property
    def trainable_networks(self) -> tuple[nn.Module, ...]:
        """The denoising networks the update trains, :attr:`transformer` first (one for every family
        but Wan 2.2 A14B, whose two experts each take a part of the noise levels)."""
        return (self.transformer,)

    @property
    def declared_networks(self) -> int:
        """How many trainable networks the checkpoint holds, known before :meth:`load` where it can be
        read (Wan 2.2 A14B: 2); 1 for every family with one transformer."""
        return 1

    def unused_modules(self) -> tuple[str, ...]:
        """Modules of :attr:`transformer` (their names in it) whose output never reaches the velocity, read
        after :meth:`load`: a LoRA adapter leaves them out, since they would get no gradient and DDP refuses a
        trained parameter that gets none (Qwen-Image's last block's text stream). Empty for most families."""
        return ()

    @property
    def boundary_timestep(self) -> float | None:
        """The timestep (σ × num_train_timesteps) at which sampling hands over from the first trainable
        network to the second (Wan 2.2 A14B's experts); ``None`` with one network."""
        return None

    def frame_problems(self, frames: int, flag: str = FRAMES_FLAG) -> list[str]:
        """Problems with a frame count for this family, found before :meth:`load` (empty when fine).

        An image family draws one frame; video families override this with their own rule."""
        if self.modality == "image" and frames != 1:
            return [
                f"{flag} ({frames!r}) must be 1 for {type(self).__name__}, an image model: set it to 1, or "
                "choose a video policy"
            ]
        return []

    def problems(self) -> list[str]:
        """Configuration problems found without loading anything (empty when fine)."""
        return []

    def sequence_parallel_problems(
        self, sp: int, height: int, width: int, frames: int, flag: str
    ) -> list[str]:
        """Why this family cannot split each sample's tokens over ``sp`` ranks at this size (empty when
        it can), found before :meth:`load` where the checkpoint's configs can be read, else after it.

        A family that can (its transformer has diffusers' context-parallel plan, and the split was
        checked against one process) overrides this; the others refuse."""
        return [
            f"{flag} ({sp}): {type(self).__name__} does not split its tokens over ranks (sequence parallelism is "
            f"built and checked for the transformers of Wan and HunyuanVideo 1.5 only): set {flag}=1"
        ]

    def image_size_problems(
        self, height: int, width: int, flags: tuple[str, str] = (HEIGHT_FLAG, WIDTH_FLAG)
    ) -> list[str]:
        """Problems with an image size for this family, found before :meth:`load` (empty when fine).

        Checks the family's constant :attr:`image_size_multiple`; once loaded, :meth:`latent_shape`
        checks the loaded checkpoint's own factors too (a tiny test model may need less). ``flags``:
        the settings the height and width come from, which the messages name.
        """
        multiple = self.image_size_multiple
        why = f" ({self.image_size_reason})" if self.image_size_reason else ""
        out = []
        for flag, value in zip(flags, (height, width), strict=True):
            if isinstance(value, bool) or not isinstance(value, int):
                out.append(f"{flag} ({value!r}) must be an integer number of pixels")
            elif value < multiple or value % multiple:
                nearest = max(multiple, round(value / multiple) * multiple)
                out.append(
                    f"{flag} ({value}) must be a positive multiple of {multiple} for {type(self).__name__}"
                    f"{why}: use {nearest}, for example"
                )
        return out

    @abstractmethod
    def load(self) -> None:
        """Read the weights (``from_pretrained``). Idempotent; only the transformer stays trainable."""

    @property
    @abstractmethod
    def transformer(self) -> nn.Module:
        """The denoising network: the only part the RL update trains (LoRA goes here)."""

    @abstractmethod
    def encode_prompts(self, prompts: Sequence[str]) -> Embeds:
        """Conditioning for ``prompts`` (no grad), cached per unique prompt. Batch-first tensors."""

    def encode(
        self,
        prompts: Sequence[str],
        conditions: Sequence[Condition] | None = None,
        height: int = 512,
        width: int = 512,
        frames: int = 1,
    ) -> Embeds:
        """Conditioning for ``prompts``, and for their records' images where they have any: what the loop
        calls. :meth:`encode_prompts` for text-only records (``conditions`` ``None``), else
        :meth:`encode_conditioned` for outputs of ``height`` x ``width`` (and ``frames``)."""
        if conditions is None:
            if self.condition_images[0] > 0:
                raise ValueError(
                    f"{type(self).__name__} needs {self.condition_name}s: give the records "
                    '"condition_images" (the data module\'s records)'
                )
            return self.encode_prompts(prompts)
        if len(conditions) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(conditions)} conditions: one per sample")
        return self.encode_conditioned(prompts, conditions, height, width, frames)

    def encode_conditioned(
        self,
        prompts: Sequence[str],
        conditions: Sequence[Condition],
        height: int,
        width: int,
        frames: int = 1,
    ) -> Embeds:
        """Conditioning for ``prompts`` and their records' images, one row per sample, for outputs of
        ``height`` x ``width`` (and ``frames``) (no grad).

        Everything the family conditions on goes into the returned batch-first tensors (source latents,
        image-encoder states, a negative prompt's rows when they depend on the source), so that the
        rollout, the update's visits and the balancing of rows over ranks carry it as they carry a prompt's;
        :meth:`velocity` reads it from there. The images arrive at their files' size: a family resizes them
        as its diffusers pipeline does for the output size. Families that take conditioning images override
        this (with :attr:`condition_images` above (0, 0))."""
        raise NotImplementedError(
            f"{type(self).__name__} takes no conditioning images: it is a text-only policy; choose an editing "
            "or image-to-video policy for records with condition_images"
        )

    def condition_size_problems(self, width: int, height: int, out_height: int, out_width: int) -> list[str]:
        """Why a conditioning image of ``width`` x ``height`` pixels cannot condition outputs of ``out_height``
        x ``out_width`` (empty when it can), found before :meth:`load`. The default takes any size."""
        return []

    @abstractmethod
    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """Predicted velocity v = ε − x0, fp32, same shape as ``latents``.

        Args:
            latents: (B, *latent_shape) in the family's latent layout.
            sigma: (B,) noise levels in [0, 1].
            embeds: conditioning with B rows.
            guidance_scale: CFG scale; ``<= 1`` means a single conditional forward. With CFG the
                conditional and unconditional halves go through the network as one batch.
        """

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Images (B, 3, H, W), or videos (B, F, 3, H, W) for a video :attr:`modality`; fp32 in [0, 1]."""

    def decode_conditioned(self, latents: Tensor, embeds: Embeds) -> Tensor:
        """:meth:`decode` of samples drawn with ``embeds`` (their rows): what the sampler calls. A family whose
        decode needs the conditioning (Wan 2.2 TI2V: the given first frame goes in front of the generated
        ones) overrides this; every other family decodes the latents alone."""
        return self.decode(latents)

    def encode_images(self, images: Tensor) -> Tensor:
        """The clean latents x0 (B, *latent) fp32 of images, in the layout :meth:`velocity` takes: the
        inverse of :meth:`decode` (what SFT and Diffusion-DPO learn from).

        Args:
            images: (B, 3, H, W) in [0, 1]; a video :attr:`modality` takes (B, F, 3, H, W).

        A family encodes as its own pipeline encodes a conditioning image (img2img, editing,
        image-to-video): the mean of the VAE's latent distribution (``retrieve_latents(...,
        sample_mode="argmax")``, deterministic, so a cached latent is the one recomputed), the family's
        normalisation, then its packing. A family that does not override this cannot learn from images.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot learn from images: it declares no encode_images (the inverse of its "
            "decode into the latents its velocity takes); train it with an RL objective, or add the method"
        )

    @abstractmethod
    def sigmas(self, num_steps: int, height: int, width: int) -> Tensor:
        """The (num_steps + 1,) fp32 noise levels of sampling, descending, ending at 0."""

    @abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Per-sample latent shape for an image of ``height`` x ``width`` pixels. A video policy takes
        a third argument, ``frames``; call :func:`latent_shape_of` to serve both."""

    def attention_shape(self, height: int, width: int) -> AttentionShape | None:
        """The transformer's joint attention at this image size (heads, head dim, text + image
        tokens), which the attention kernel is chosen for; ``None``: not a family with known faults."""
        return None

    #: The family's diffusers pipeline class, by name (``_class_name`` in ``model_index.json``).
    pipeline_name: str = ""

    @property
    def pipeline_class(self) -> Any:
        """The pipeline class, imported on first use: importing diffusers' pipeline modules loads
        transformers' image processors (and their notices), which a run of another family never needs."""
        if not self.pipeline_name:
            raise NotImplementedError(f"{type(self).__name__} has no diffusers pipeline")
        import diffusers
        from transformers.utils import logging as transformers_logging

        # Importing a pipeline module imports the image processors its image-conditioned siblings use
        # (CLIP's, SigLIP's); without torchvision, transformers then notes on every run that it falls
        # back to their PIL versions. No policy here uses an image processor, so the note says nothing
        # about this run: it is silenced for the import alone.
        level = transformers_logging.get_verbosity()
        transformers_logging.set_verbosity_error()
        try:
            return getattr(diffusers, self.pipeline_name)
        finally:
            transformers_logging.set_verbosity(level)

    def save_lora(self, path: str, lora_state_dict: dict[str, Tensor], adapter_metadata: dict | None) -> None:
        """Write a LoRA adapter that the family's diffusers pipeline loads with ``load_lora_weights``."""
        self.pipeline_class.save_lora_weights(
            path,
            transformer_lora_layers=lora_state_dict,
            transformer_lora_adapter_metadata=adapter_metadata,
        )

    def flops_forward(self, height: int, width: int, frames: int = 1) -> Callable[[], Tensor]:
        """A closure running one single-sample, no-CFG transformer forward (for FLOP counting).

        Policies override this when the default (encode an empty prompt, random latents) does not
        fit their layout.
        """
        shape = latent_shape_of(self, height, width, frames)
        device = next(self.transformer.parameters()).device

        def forward() -> Tensor:
            embeds = self.encode_prompts([""])
            latents = torch.zeros((1, *shape), device=device)
            return self.velocity(latents, torch.full((1,), 0.5, device=device), embeds, 1.0)

        return forward


#: How far (in log aspect ratio) a conditioning image may be from the outputs' before a resize to the output's
#: grid visibly stretches it: 1 %, less than one 16-pixel step at 512 px (log(528 / 512) = 3 %).
ASPECT_TOLERANCE = 0.01


def aspect_ratio_differs(width: int, height: int, out_width: int, out_height: int) -> bool:
    """Whether an image of ``width`` x ``height`` is farther than :data:`ASPECT_TOLERANCE` (in log aspect ratio)
    from outputs of ``out_width`` x ``out_height`` (what the editing families refuse before load)."""
    return abs(math.log((width / height) / (out_width / out_height))) > ASPECT_TOLERANCE


def check_one_image_each(policy: FlowPolicy, conditions: Sequence[Condition]) -> None:
    """Raise a ``ValueError`` naming the first record whose conditioning is not one image, for a family of
    ``condition_images = (1, 1)`` called directly (the data module's records were checked before load)."""
    for condition in conditions:
        if len(condition.images) != 1:
            raise ValueError(
                f"{type(policy).__name__} takes one {policy.condition_name} a record, got {len(condition.images)} "
                f"({condition.key}): give each record one path in condition_images"
            )


def vae_pixels(vae: nn.Module, images: Tensor) -> Tensor:
    """Images in [0, 1] as a diffusers VAE takes them: in [-1, 1] (``VaeImageProcessor.normalize``), on the
    VAE's device and in its dtype."""
    return (images * 2.0 - 1.0).to(device=next(vae.parameters()).device, dtype=vae.dtype)


def video_latent_shape(
    policy: FlowPolicy,
    channels: int,
    size: tuple[int, int, int],
    factors: tuple[int, int],
    patches: tuple[int, int],
) -> tuple[int, int, int, int]:
    """(C, (F − 1)/t + 1, H/s, W/s) of a causal video VAE's latent for ``size`` = (height, width, frames),
    ``factors`` = (spatial s, temporal t) and the transformer's (height, width) ``patches``.

    Raises:
        ValueError: naming each sampler setting that does not fit (the frames as ``policy.frame_problems``
            says; height and width must be multiples of s × patch).
    """
    height, width, frames = size
    spatial, temporal = factors
    problems = [] if (frames - 1) % temporal == 0 else policy.frame_problems(frames)
    for flag, value, patch in ((HEIGHT_FLAG, height, patches[0]), (WIDTH_FLAG, width, patches[1])):
        if value % (spatial * patch):
            problems.append(
                f"{flag} ({value}) must be a multiple of {spatial * patch} for this checkpoint (its VAE "
                f"downsamples by {spatial}, its transformer cuts patches of {patch})"
            )
    if problems:
        raise ValueError("; ".join(problems))
    return (channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)


def checked_sigmas(scheduler: Any, num_steps: int, flag: str, policy: str, hint: str = "") -> Tensor:
    """``scheduler.sigmas`` (fp32) after its ``set_timesteps``, which must be ``num_steps`` + 1 levels ending
    at 0 (the last Euler / SDE step lands on the clean sample); else a ``ValueError`` naming ``flag``, with
    ``hint`` after it."""
    sigmas = torch.as_tensor(scheduler.sigmas, dtype=torch.float32)
    if sigmas.numel() != num_steps + 1 or float(sigmas[-1]) != 0.0:
        raise ValueError(
            f"{flag}: its {type(scheduler).__name__} gives {sigmas.numel()} noise levels ending at "
            f"{float(sigmas[-1])} for {num_steps} steps; {policy} needs num_steps + 1 ending at 0{hint}"
        )
    return sigmas


def latent_shape_of(policy: FlowPolicy, height: int, width: int, frames: int = 1) -> tuple[int, ...]:
    """The per-sample latent shape of a sample of ``frames`` frames of ``height`` x ``width`` pixels:
    ``policy.latent_shape(height, width, frames)`` for a video policy, ``(height, width)`` for an image
    policy (whose signature has no frames; one frame is all it draws)."""
    if policy.modality == "video":
        return tuple(policy.latent_shape(height, width, frames))  # type: ignore[call-arg]
    if frames != 1:
        raise ValueError(FlowPolicy.frame_problems(policy, frames)[0])
    return tuple(policy.latent_shape(height, width))


def reward_modality_problems(
    policy: FlowPolicy, reward: Any, flag: str = "--model.init_args.reward"
) -> list[str]:
    """The rewards that cannot score what ``policy`` draws (empty when all can).

    A reward declares what it scores in ``modalities`` (a set of ``"image"``, ``"video"``); one that
    declares nothing scores images. The components of a :class:`~lit_flowgrpo.rewards.MultiReward`
    (its ``rewards`` mapping) are checked one by one, each by its name.
    """
    modality = policy.modality
    parts = getattr(reward, "rewards", None)
    named = dict(parts) if isinstance(parts, dict) else {type(reward).__name__: reward}
    out = []
    for name, part in named.items():
        if modality not in getattr(part, "modalities", {"image"}):
            fix = (
                "wrap it in lit_flowgrpo.rewards.video.PerFrame (which scores each frame and averages)"
                if modality == "video"
                else "choose a reward that scores images"
            )
            out.append(
                f"{flag}: the reward {name!r} ({type(part).__name__}) cannot score the {modality}s "
                f"{type(policy).__name__} draws: {fix}"
            )
    return out
