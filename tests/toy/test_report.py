"""The quickstart's base-vs-tuned picture: each sample's frame says what the verifier decided."""

from __future__ import annotations

import torch

from lit_flowgrpo.toy.report import base_vs_tuned_grid

GREEN, RED = (40, 200, 70), (220, 50, 50)


def test_frames_follow_the_pass_flags_and_columns_follow_the_samples() -> None:
    n, scale, frame = 3, 4, 3
    base_passed = torch.tensor([True, False, True])
    tuned_passed = torch.tensor([False, False, True])
    grid = base_vs_tuned_grid(
        torch.zeros(n, 3, 32, 32), torch.zeros(n, 3, 32, 32), ["a red circle"] * n, base_passed, tuned_passed,
        scale=scale,
    )  # fmt: skip
    tile, cell_w, pad, label_w, text_h = 32 * scale, 32 * scale + 2 * frame + 6, 6, 44, 11
    assert grid.width == label_w + n * cell_w + pad  # three columns, not a full row of eight
    for i in range(n):
        x = label_w + pad + i * cell_w + 1  # inside the left frame edge
        for k, flags in enumerate((base_passed, tuned_passed)):
            y = pad + text_h + k * (tile + 2 * frame) + frame + tile // 2
            assert grid.getpixel((x, y)) == (GREEN if flags[i] else RED)
            assert grid.getpixel((x + frame + tile // 2, y)) == (0, 0, 0)  # the (black) sample itself


def test_without_flags_there_is_no_frame_and_no_legend() -> None:
    with_flags = base_vs_tuned_grid(
        torch.zeros(2, 3, 32, 32), torch.zeros(2, 3, 32, 32), ["a"] * 2, torch.ones(2).bool()
    )
    plain = base_vs_tuned_grid(torch.zeros(2, 3, 32, 32), torch.zeros(2, 3, 32, 32), ["a"] * 2)
    assert plain.height < with_flags.height
    assert plain.getpixel((44 + 6 + 1, 6 + 11 + 3 + 64)) == (30, 30, 30)  # background where a frame would be
