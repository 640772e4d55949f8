"""Request traces: kvstrata's format (:mod:`.format`), the reader of every format
``kvstrata bench`` takes (:mod:`.reader`), the plugin's recorder (:mod:`.recorder`)
and the reader of its recordings (:mod:`.recording`)."""
