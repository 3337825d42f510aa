"""Every picture mlaspec draws (masks, page maps, byte layouts, chunk schedules, error heat maps).

The report, the docs and the notebooks all draw through these functions; each returns a matplotlib Figure.
"""
