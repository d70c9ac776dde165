"""GCS clauses: the Ray head's memory limit, GCS fault tolerance and the blast radius of a head OOM."""
