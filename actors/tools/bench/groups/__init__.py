"""``wt bench groups``: replica groups over slow links; ``driver.py`` runs in each group."""
