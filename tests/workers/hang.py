import time

time.sleep(300)
