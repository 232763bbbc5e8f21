"""AutoCache: the frozen prefix's outputs per sample, stored, guarded and run inside a job."""
