"""The two trees microbatch walks: a model's modules and a batch's tensors.

``modules``: finding, replacing and naming submodules (and looking through ``torch.compile``);
``batches``: a batch's size, slices, splits and device moves, for any nesting of tensors in
lists, tuples (named too) and mappings.

May import: ``errors``. The lowest layer beside ``errors``: everything may import it.
"""

from __future__ import annotations
