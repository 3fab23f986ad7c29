"""The sampling contract every layer shares, without torch: the readout's fixed widths and
the sentinel it reports when no position emitted EOS."""

from __future__ import annotations

NO_EOS = 1 << 20  # EOS position reported when no position emitted EOS
TOP_K_SAMPLE = 8  # the decoder's Gumbel top-k width: sampling draws among the top 8
