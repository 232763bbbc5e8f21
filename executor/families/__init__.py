"""Model families: each family's layers, weights, tensor-parallel split and sliced attention."""
