"""Building a plan: match engine tensors to parameters, shard-direct pieces, assign, validate."""
