"""Values every stage shares: the group lattice (``groups``), group elements as index vectors
and small blocks (``elements``), statistics summed across processes (``distributed``), and the
finiteness check of weights (``finite``), and one line for a value an options schema refuses
(``schema``)."""
