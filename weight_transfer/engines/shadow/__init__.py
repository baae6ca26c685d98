"""Shadow weights: a second copy of every engine tensor, staged by updates and flipped."""
