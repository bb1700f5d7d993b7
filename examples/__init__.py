"""Examples: a small vision-language model trained with lightning_vlmbalance on the CPU."""
