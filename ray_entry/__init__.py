"""`python -m ray_entry.train base.yml key=value ...`: the maxlite loop on every Ray worker."""
