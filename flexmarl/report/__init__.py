"""What a user keeps after a run: pictures, ``report.md`` / ``report.html``, and the timeline file."""
