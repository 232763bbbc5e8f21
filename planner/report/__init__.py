"""The plan report: plotly figures and the one offline HTML file (``ptplan show``, ``ptplan plan --report``)."""
