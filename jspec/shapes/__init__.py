"""Fixed shapes: the buckets every program is compiled for (buckets.py), maps over chunks of
an axis (chunks.py), and a shard's rows gathered and scattered (rows.py). Below the loop, the
drafters and the memory plan, which all size their arrays by them."""
