"""TorchScript archives made by the tests: a CLIP-like one (plain weights) and a crafted one whose ``__setstate__``
creates a marker file when ``torch.jit.load`` reads it (``torch.from_file(path, shared=True)`` creates the file)."""
from __future__ import annotations

import torch
from torch import nn


class Trap(nn.Module):
    """Writes ``marker`` at load: TorchScript calls ``__setstate__`` with the state ``__getstate__`` saved."""

    def __init__(self, marker: str):
        super().__init__()
        self.marker = marker
        self.created = 0

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.marker, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.marker = state[0]
        self.training = state[1]
        self.created = torch.from_file(self.marker, True, 8).numel()  # kept, so the call is not optimised away

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class TrappedVisual(nn.Module):
    """A ``visual`` tower with the trap inside, as an archive sent as 'OpenAI CLIP weights' would hold it."""

    def __init__(self, visual: nn.Module, marker: str):
        super().__init__()
        self.visual = visual
        self.trap = Trap(marker)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.visual(self.trap(image))


def save_trapped_archive(path: str, marker: str, visual: nn.Module | None = None) -> None:
    """A scripted archive whose loading by ``torch.jit.load`` creates ``marker``."""
    visual = visual if visual is not None else nn.Conv2d(3, 4, 2)
    torch.jit.script(TrappedVisual(visual, marker)).save(path)
