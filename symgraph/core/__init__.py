"""Values every stage shares: the group lattice (``groups``), group elements as index vectors
and small blocks (``elements``), and statistics summed across processes (``distributed``)."""
