return { data = "d",, }
