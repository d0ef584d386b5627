"""The traffic a trial sends: synthetic, shaped or replayed workloads and what they measured."""
