"""Tiny, randomly initialised pipelines of each family, written to a folder and loaded back.

Model weights cannot be assumed present (CI, a laptop), so tests and the tiny configs build
miniature pipelines in code, `save_pretrained` them to a folder and load them through exactly the
`from_pretrained` path a real hub id or checkout goes through. Tokenizers are made locally too:

    python -m lit_flowgrpo.tiny.sd3 .tiny_models/sd3
    python -m lit_flowgrpo.tiny.flux .tiny_models/flux
    python -m lit_flowgrpo.tiny.flux_kontext .tiny_models/flux_kontext
    python -m lit_flowgrpo.tiny.flux2 .tiny_models/flux2        (FLUX.2 dev: .tiny_models/flux2_dev dev)
    python -m lit_flowgrpo.tiny.qwenimage .tiny_models/qwenimage
    python -m lit_flowgrpo.tiny.qwenimage_edit .tiny_models/qwenimage_edit   (2511: .tiny_models/qwenimage_edit_2511 2511)
    python -m lit_flowgrpo.tiny.wan .tiny_models/wan            (a14b: .tiny_models/wan22_a14b a14b)
    python -m lit_flowgrpo.tiny.wan_i2v .tiny_models/wan_i2v    (TI2V-5B form: .tiny_models/wan22_ti2v ti2v)
    python -m lit_flowgrpo.tiny.zimage .tiny_models/zimage      (Z-Image base: .tiny_models/zimage_base base)
    python -m lit_flowgrpo.tiny.hunyuanvideo15 .tiny_models/hunyuanvideo15

Each tiny model is its family's public config (:mod:`lit_flowgrpo.tiny.specs`, which the benchmarks
build full-size models from) with small overrides, so that the two never restate a config.
"""

from lit_flowgrpo.tiny.tokenizers import clip_tokenizer, qwen3_tokenizer, t5_tokenizer

__all__ = ["clip_tokenizer", "qwen3_tokenizer", "t5_tokenizer"]
