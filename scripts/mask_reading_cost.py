"""Host time hasten spends reading transformers' causal mask function over a run whose packed rows
all differ in length (2,000 forwards, rows of 3,500-4,600 tokens, seeded), and the readings kept.
The figure behind integrations/masks.py's per-grid readings (855 ms before, 9 ms after, CPU).

    python scripts/mask_reading_cost.py [src folder of the hasten to time, default this checkout's]
"""
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[1] / "src"))
from transformers import masking_utils  # noqa: E402

import hasten.integrations.masks as masks  # noqa: E402

rng = random.Random(0)
lengths = [rng.randint(3500, 4600) for _ in range(2000)]
start = time.perf_counter()
for length in lengths:
    masks.read_band(masking_utils.causal_mask_function, length)
spent = time.perf_counter() - start
print(f"{masks.__file__}: {len(lengths)} forwards, rows of 3,500-4,600 tokens: {spent * 1e3:.0f} ms of mask "
      f"readings ({spent / len(lengths) * 1e6:.0f} us a forward), {len(masks._READINGS)} readings kept")
