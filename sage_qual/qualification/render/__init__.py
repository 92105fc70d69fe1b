"""Views of a report and its decisions: report.md/html, plots, tables, summary, JUnit XML; no disk reads."""
