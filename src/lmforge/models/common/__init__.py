"""Building blocks shared by every model family (norms, RoPE, attention, MLA, MLP, MoE, head, loss)."""
