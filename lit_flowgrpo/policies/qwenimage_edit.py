"""Qwen-Image-Edit-2509 / 2511 (``QwenImageEditPlusPipeline``) behind the
:class:`~lit_flowgrpo.policies.base.FlowPolicy` interface: an instruction and one to three source images.

The transformer is Qwen-Image's (:class:`~lit_flowgrpo.policies.qwenimage.QwenImagePolicy`: packed latents,
dynamic-shift schedule from the output's token count alone, true CFG with the norm rescale, decoding).
What editing adds, each done with the loaded pipeline's own code:

- the prompt goes through Qwen2.5-VL *with the sources*: ``QwenImageEditPlusPipeline.encode_prompt(image=...)``
  writes ``Picture k: <|vision_start|><|image_pad|><|vision_end|>`` per source before the instruction and the
  vision tower's states fill the ``<|image_pad|>`` tokens, so the prompt's rows hold hundreds of vision
  tokens. The negative prompt is encoded with the same sources (as the pipeline does), so its rows depend
  on the record too and travel in the conditioning (``negative_prompt_embeds``), not in a shared cache;
- each source's VAE latent (``prepare_latents``: the mean of the latent distribution, ``(z − mean) / std``,
  2×2 packing) is joined after the noisy tokens, ``img_shapes`` lists the output's and each source's grid
  (RoPE), and only the first N (the output's) tokens of the transformer's output are kept, as the
  pipeline's denoising loop does. 2511's ``zero_cond_t`` (timestep 0 for the source tokens) is the
  transformer's own config and needs nothing here.

How the sources are sized for RL. ``QwenImageEditPlusPipeline.__call__`` resizes every source twice, each at
its own aspect ratio with sides rounded to 32 (``calculate_dimensions``): to about 384² pixels for the
vision encoder (``CONDITION_IMAGE_SIZE``) and to about 1024² for the VAE (``VAE_IMAGE_SIZE``), whatever the
output size: at 512² outputs the sources would add 4096 tokens per image to the output's 1024. flow_grpo's
``scripts/train_qwenimage_edit_plus.py`` resizes each source to the training resolution and VAE-encodes it
at the output's area (``calculate_dimensions(512 * 512, ...)``), so a source costs as many tokens as the
output. This policy does the same by default (``source_area=None``: each source's VAE copy is the output
size of the call, the rollout's or validation's); ``source_area`` set to a pixel count restores the
pipeline's rule at that area (1024² is the pipeline's). The vision encoder's copy is the pipeline's
(``vision_area``, 384²).

Every sample of a batch must have one sequence length, and the transformer's RoPE reads the first sample's
``img_shapes`` for all of them, so every sample of a batch must have the same source grids. The rule that
guarantees it, checked per image before any weight loads (:meth:`QwenImageEditPlusPolicy.condition_size_problems`):
a source must have the outputs' aspect ratio (within 1 %; with ``source_area`` set, its VAE copy must come
out at the size the outputs' aspect ratio gives). Every record of a prompt set must also give the same number
of sources (``condition_counts_agree``: refused before load; a batch that mixes counts anyway is refused when
it is encoded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from transformers import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin

from lit_flowgrpo.attention import AttentionShape
from lit_flowgrpo.policies.base import (
    OUTPUT_SIZE_FLAGS,
    DType,
    Embeds,
    aspect_ratio_differs,
    cat_embeds,
    pretrained_dtype_kwargs,
    resolve_dtype,
)
from lit_flowgrpo.policies.packed import PRETRAINED_FLAG, padded_prompts
from lit_flowgrpo.policies.qwenimage import QwenImagePolicy

if TYPE_CHECKING:
    from lit_flowgrpo.conditioning import Condition

_FLAGS = "--model.init_args.policy.init_args"
#: The pipeline's own sizes of a source's two copies (``CONDITION_IMAGE_SIZE``, ``VAE_IMAGE_SIZE``).
PIPELINE_VISION_AREA = 384 * 384
PIPELINE_SOURCE_AREA = 1024 * 1024


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """``Qwen2VLProcessor`` without its video processor: the image processor and the tokenizer only.

    The edit pipeline sends the processor text and images, never video; transformers builds a Qwen2-VL
    processor's video processor with torchvision, which this package does not depend on. Everything the
    pipeline calls (``__call__`` with ``text`` and ``images``: the image processor's patches and grid, the
    ``<|image_pad|>`` expansion by ``replace_image_token``) is ``Qwen2VLProcessor``'s own code.
    """

    def __init__(
        self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any
    ):
        # Qwen2VLProcessor.__init__ resolves the same token names, then passes a video processor on.
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def load_processor(pretrained: str) -> ImageOnlyQwen2VLProcessor:
    """The ``processor/`` of a Qwen-Image-Edit pipeline folder or hub id, as :class:`ImageOnlyQwen2VLProcessor`."""
    return ImageOnlyQwen2VLProcessor.from_pretrained(pretrained, subfolder="processor")


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of ``area`` pixels at aspect ratio ``ratio`` = width / height, sides rounded to 32:
    ``diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus.calculate_dimensions``, called through."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    width, height = pipeline_qwenimage_edit_plus.calculate_dimensions(area, ratio)
    return int(width), int(height)


class QwenImageEditPlusPolicy(QwenImagePolicy):
    """Qwen-Image-Edit-2509 / 2511 editing (``Qwen/Qwen-Image-Edit-2509``, ``Qwen/Qwen-Image-Edit-2511``): a
    prompt (the instruction) and one to three source images per record, true CFG.

    Conditioning rows: ``prompt_embeds`` / ``prompt_embeds_mask`` and ``negative_prompt_embeds`` /
    ``negative_prompt_embeds_mask`` (B, max_sequence_length, D), each zero-padded with its mask, the sources
    seen by the vision encoder; ``source_latents`` (B, S, 64), every source's packed VAE latent one after the
    other; ``source_shapes`` (B, n, 2) int64, each source's (rows, cols) of 2×2 patches. Sizing rule: the
    module's docstring.

    Args:
        pretrained: Hub id or local folder of a ``QwenImageEditPlusPipeline`` (what ``save_pretrained`` writes).
        dtype: Weights' dtype; the step math stays fp32.
        true_cfg_scale: The family's CFG scale (4: the pipeline's default and flow_grpo's recipe). :meth:`velocity`
            uses the scale it is given (the training loop's ``--model.init_args.sampler.guidance_scale``): set
            both alike. The negative prompt's rows are encoded only when this is above 1.
        negative_prompt: The unconditional prompt, encoded with the record's sources (" ", as flow_grpo).
        max_sequence_length: Prompt tokens allowed per record, the sources' vision tokens included (a 384²
            source is about 200 of them); longer encodings are refused, naming this setting.
        prompt_cache_size: Records (prompt, sources, output size) whose encodings stay cached (least
            recently used dropped).
        source_area: Pixels of each source's VAE copy at its own aspect ratio (sides rounded to 32, as
            the pipeline); ``None``: the output size of the call (flow_grpo's training rule); 1048576
            (1024²) is the pipeline's inference rule.
        vision_area: Pixels of each source's copy that the vision encoder sees (the pipeline's 384²).
    """

    condition_images: tuple[int, int] = (1, 3)
    condition_counts_agree = True
    condition_name: str = "source image"
    pipeline_name = "QwenImageEditPlusPipeline"
    component_names = ("text_encoder", "vae")

    def __init__(
        self,
        pretrained: str,
        dtype: DType = "bfloat16",
        true_cfg_scale: float = 4.0,
        negative_prompt: str = " ",
        max_sequence_length: int = 1024,
        prompt_cache_size: int = 256,
        source_area: int | None = None,
        vision_area: int = PIPELINE_VISION_AREA,
    ) -> None:
        super().__init__(
            pretrained, dtype, true_cfg_scale, negative_prompt, max_sequence_length, prompt_cache_size
        )
        # The sources' vision tokens count too; text RoPE positions run up to 4096 minus the image grid's.
        self._max_tokens = 2048
        self.source_area = source_area
        self.vision_area = vision_area

    def problems(self) -> list[str]:
        out = super().problems()
        for name, value in (("source_area", self.source_area), ("vision_area", self.vision_area)):
            if value is None and name == "source_area":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 32 * 32:
                out.append(
                    f"{_FLAGS}.{name} ({value!r}) must be a pixel count of at least 1024 (32 x 32): the copies are "
                    f"sized in steps of 32 pixels (the pipeline's {name} is "
                    f"{PIPELINE_SOURCE_AREA if name == 'source_area' else PIPELINE_VISION_AREA})"
                )
        return out

    # -- loading ------------------------------------------------------------------------------------

    def _read_pipeline(self) -> Any:
        (key,) = pretrained_dtype_kwargs(torch.float32)  # the dtype keyword's name in this diffusers
        try:
            # The processor is read here (the image processor and the tokenizer) and handed over, so that
            # loading needs no torchvision (ImageOnlyQwen2VLProcessor); the rest is the pipeline's own load.
            return self.pipeline_class.from_pretrained(
                self.pretrained,
                processor=load_processor(self.pretrained),
                **{key: resolve_dtype(self.dtype_name)},
            )
        except (OSError, ValueError) as err:
            raise ValueError(
                f"{PRETRAINED_FLAG} ({self.pretrained}): loading the {self.pipeline_name} failed: {err}"
            ) from err

    # -- the sources --------------------------------------------------------------------------------

    def _source_size(self, width: int, height: int, out_height: int, out_width: int) -> tuple[int, int]:
        """(width, height) of a ``width`` x ``height`` source's VAE copy for outputs of that size."""
        if self.source_area is None:
            return out_width, out_height
        return calculate_dimensions(self.source_area, width / height)

    def condition_size_problems(self, width: int, height: int, out_height: int, out_width: int) -> list[str]:
        """A source whose VAE copy would not have the grid every other sample's has (the batch's sequences
        must agree), or that the resize would stretch: it must have the outputs' aspect ratio."""
        fix = (
            f"crop or pad the sources to the outputs' aspect ratio ({out_width}:{out_height}), or sample at a size "
            f"of theirs ({OUTPUT_SIZE_FLAGS})"
        )
        if aspect_ratio_differs(width, height, out_width, out_height):
            return [
                f"its aspect ratio ({width}x{height}) is not the outputs' ({out_width}x{out_height}): "
                f"{type(self).__name__} resizes every source to one grid so that a batch's sequences agree, and "
                f"would stretch it; {fix}"
            ]
        if self.source_area is not None:
            got = self._source_size(width, height, out_height, out_width)
            want = calculate_dimensions(self.source_area, out_width / out_height)
            if got != want or min(got) < 32:
                return [
                    f"its VAE copy at {_FLAGS}.source_area ({self.source_area}) would be {got[0]}x{got[1]} pixels, "
                    f"but sources of the outputs' aspect ratio come out at {want[0]}x{want[1]}: a batch's samples "
                    f"must have one sequence length; {fix}"
                ]
        return []

    @torch.no_grad()
    def encode_conditioned(
        self,
        prompts: Sequence[str],
        conditions: Sequence[Condition],
        height: int,
        width: int,
        frames: int = 1,
    ) -> Embeds:
        """One row per sample for outputs of ``height`` x ``width``: the prompt and the negative prompt encoded
        with the record's sources, and the sources' packed latents; each (prompt, sources, size) is encoded
        once, alone (as :class:`~lit_flowgrpo.policies.base.PromptCache` explains), and cached."""
        if frames != 1:
            raise ValueError(self.frame_problems(frames)[0])
        self._packed_grid(height, width)  # checks the output size before any source is encoded
        counts = sorted({len(c.images) for c in conditions})
        if len(counts) > 1 or not self.condition_images[0] <= counts[0] <= self.condition_images[1]:
            raise ValueError(
                f"{type(self).__name__}: the records of one batch give {counts} {self.condition_name}s; every "
                f"sample of a batch must have one sequence length, so give every record the same number of "
                f"condition_images, from {self.condition_images[0]} to {self.condition_images[1]}"
            )
        keys = [f"{p}\0{c.key}\0{height}x{width}" for p, c in zip(prompts, conditions, strict=True)]
        jobs = dict(zip(keys, zip(prompts, conditions, strict=True), strict=True))
        rows = self._cache.rows(keys, lambda key: self._encode_record(*jobs[key], height, width))
        return self._collate_records(rows)

    def _encode_record(self, prompt: str, condition: Condition, height: int, width: int) -> Embeds:
        """One record's rows (batch dimension 1, prompts unpadded), as ``QwenImageEditPlusPipeline.__call__``
        encodes its prompt, negative prompt and sources for outputs of ``height`` x ``width``."""
        pipe = self.pipe
        processor = pipe.image_processor
        vision, pixels = [], []
        for image in condition.images:
            # The pipeline takes PIL images and resizes them with Lanczos; the file's 8-bit pixels are
            # recovered exactly from the [0, 1] tensor (k / 255, rounded back to k).
            (pil,) = processor.numpy_to_pil(processor.pt_to_numpy(image[None].float().cpu()))
            vision_width, vision_height = calculate_dimensions(self.vision_area, pil.width / pil.height)
            vision.append(processor.resize(pil, vision_height, vision_width))
            source_width, source_height = self._source_size(pil.width, pil.height, height, width)
            pixels.append(
                processor.preprocess(pil, source_height, source_width).unsqueeze(2)
            )  # (1, 3, 1, h, w)
        device = self.text_encoder.device
        rows = {"prompt_embeds": self._prompt_rows(prompt, vision, device)}
        if self.true_cfg_scale > 1:
            rows["negative_prompt_embeds"] = self._prompt_rows(self.negative_prompt, vision, device)
        # Given latents, prepare_latents draws no noise and returns them untouched: only its image path runs
        # (each source VAE-encoded alone, normalised, packed, joined along the sequence).
        vae = self.vae
        _, source = pipe.prepare_latents(
            pixels,
            1,
            self.transformer.config.in_channels // 4,
            height,
            width,
            rows["prompt_embeds"].dtype,  # the pipeline encodes the sources in the prompt's dtype
            next(vae.parameters()).device,
            None,
            torch.empty(0),
        )
        f = 2 * self.vae_scale_factor
        shapes = [(p.shape[-2] // f, p.shape[-1] // f) for p in pixels]
        rows["source_latents"] = source  # (1, S, 4C)
        rows["source_shapes"] = torch.tensor([shapes], dtype=torch.long, device=source.device)  # (1, n, 2)
        return rows

    def _prompt_rows(self, prompt: str, vision: list[Any], device: torch.device) -> Tensor:
        """The prompt's unpadded (1, L, D) states with the sources seen (``encode_prompt(image=...)``)."""
        embeds, mask = self.pipe.encode_prompt(prompt=[prompt], image=vision, device=device)
        length = embeds.shape[1] if mask is None else int(mask.sum())
        if length > self.max_sequence_length:
            raise ValueError(
                f"{_FLAGS}.max_sequence_length ({self.max_sequence_length}) is shorter than the {length} tokens of "
                f"{prompt[:60]!r} with its {len(vision)} source(s) (each source is about vision_area / 784 tokens): "
                f"raise it (at most {self._max_tokens}), or lower {_FLAGS}.vision_area"
            )
        return embeds[:, :length]

    def _collate_records(self, rows: list[Embeds]) -> Embeds:
        out = padded_prompts(rows, self.max_sequence_length)
        if "negative_prompt_embeds" in rows[0]:
            neg = padded_prompts(
                [{"prompt_embeds": r["negative_prompt_embeds"]} for r in rows], self.max_sequence_length
            )
            out["negative_prompt_embeds"], out["negative_prompt_embeds_mask"] = (
                neg["prompt_embeds"],
                neg["prompt_embeds_mask"],
            )
        out.update(cat_embeds([{k: r[k] for k in ("source_latents", "source_shapes")} for r in rows]))
        return out

    # -- the network --------------------------------------------------------------------------------

    def velocity(self, latents: Tensor, sigma: Tensor, embeds: Embeds, guidance_scale: float) -> Tensor:
        """v = ε − x0 of the output's tokens: one forward over [output; sources] tokens, with CFG over
        [cond; uncond] rows in the same batch, keeping the first N tokens (``QwenImageEditPlusPipeline``)."""
        batch, rows, cols = self._check_packed(latents)
        if "source_latents" not in embeds:
            raise ValueError(
                f"{type(self).__name__}.velocity needs the sources' latents in its conditioning: encode with "
                "policy.encode(prompts, conditions, height, width) (records with condition_images)"
            )
        shapes = embeds["source_shapes"]
        if not bool((shapes == shapes[:1]).all()):
            raise ValueError(
                f"the samples of one batch have sources of different grids ({shapes.tolist()}); the transformer "
                "takes one img_shapes for the whole batch: give every record sources of the outputs' aspect ratio"
            )
        img_shapes = [[(1, rows, cols), *((1, int(r), int(c)) for r, c in shapes[0].tolist())]]
        transformer = self.transformer
        dtype = self.input_dtype(transformer)
        device = latents.device
        cfg = guidance_scale > 1.0
        prompt_embeds, mask = embeds["prompt_embeds"], embeds["prompt_embeds_mask"]
        x = torch.cat([latents.to(dtype), embeds["source_latents"].to(device, dtype)], dim=1)  # (B, N + S, C)
        timestep = sigma.to(device=device, dtype=torch.float32).expand(batch)
        if cfg:
            if "negative_prompt_embeds" not in embeds:
                raise ValueError(
                    f"guidance_scale {guidance_scale} asks for CFG, but {_FLAGS}.true_cfg_scale "
                    f"({self.true_cfg_scale}) is not above 1, so no negative prompt was encoded: set both alike"
                )
            prompt_embeds = torch.cat([prompt_embeds, embeds["negative_prompt_embeds"]])
            mask = torch.cat([mask, embeds["negative_prompt_embeds_mask"]])
            x, timestep = torch.cat([x, x]), torch.cat([timestep, timestep])
        # Cut the shared padding; an all-real mask is dropped as the pipeline drops it.
        length = int(mask.sum(dim=1).max())
        prompt_embeds, mask = prompt_embeds[:, :length], mask[:, :length]
        out = transformer(
            hidden_states=x,
            timestep=timestep.to(dtype),
            encoder_hidden_states=prompt_embeds.to(device, dtype),
            encoder_hidden_states_mask=None if bool(mask.all()) else mask.to(device),
            img_shapes=img_shapes * x.shape[0],
            return_dict=False,
        )[0][:, : latents.shape[1]].float()  # the output's tokens
        if not cfg:
            return out
        cond, uncond = out.chunk(2)
        # True CFG, then rescale each token to the conditional prediction's norm (the pipeline's loop).
        comb = uncond + guidance_scale * (cond - uncond)
        return comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))

    def attention_shape(self, height: int, width: int) -> AttentionShape:
        # Prompt tokens (the sources' vision tokens among them), the output's packed patches and one
        # source's (at source_area None, as many as the output's).
        rows, cols = self._packed_grid(height, width)
        f = 2 * self.vae_scale_factor
        if self.source_area is None:
            source = rows * cols
        else:
            w, h = calculate_dimensions(self.source_area, width / height)
            source = (h // f) * (w // f)
        config = self.transformer.config
        return AttentionShape(
            config.num_attention_heads,
            config.attention_head_dim,
            self.max_sequence_length + rows * cols + source,
            masked=self.masked_prompts,
        )

    def flops_forward(self, height: int, width: int, frames: int = 1) -> Callable[[], Tensor]:
        """One single-sample, no-CFG forward with one (gray) source of the output's size: a step's work."""
        from lit_flowgrpo.conditioning import Condition

        shape = self.latent_shape(height, width)
        device = self.device
        source = Condition([torch.full((3, height, width), 0.5)], key="<flops>")
        self.encode_conditioned(
            [""], [source], height, width
        )  # cached: the count holds the transformer alone

        def forward() -> Tensor:
            embeds = self.encode_conditioned([""], [source], height, width)
            latents = torch.zeros((1, *shape), device=device)
            return self.velocity(latents, torch.full((1,), 0.5, device=device), embeds, 1.0)

        return forward
