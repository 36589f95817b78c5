"""attnpool: core attention disaggregation for long-context training."""
