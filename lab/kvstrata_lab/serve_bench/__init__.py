"""`kvstrata serve-bench`: real `kvstrata serve` processes (`process`) under scripted multi-turn agent
load (`agents`) from the official `openai` client (`bench`), summarised and plotted (`report`)."""
