"""What one tick reads of a server (its snapshot) and the figures derived from it: the
values the rules evaluate and the exposition writes, below both the tick and the rules."""
