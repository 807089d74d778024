return { data = os.getenv("HOME") .. tostring(undefined_thing) }
