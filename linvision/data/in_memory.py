"""A dataset held in memory as PIL images and integer targets: what the offline sets (digits, photo crops) are."""
from __future__ import annotations

from typing import Callable, List, Optional

from PIL import Image
from torch.utils.data import Dataset

__all__ = ["InMemoryImages"]


class InMemoryImages(Dataset):
    """A dataset held as lists ``images`` (PIL) and ``targets`` (ints), with an optional ``transform``."""

    images: List[Image.Image]
    targets: List[int]
    transform: Optional[Callable] = None

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img = self.images[index]
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]
