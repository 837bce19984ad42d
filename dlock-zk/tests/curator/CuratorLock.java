// Takes an Apache Curator InterProcessMutex, as a Curator application
// would, for dlock-zk's interoperability test: run by the JDK's
// single-file launcher, `java -cp JARS CuratorLock.java CONNECT PATH
// HOLD_MS DONE_FILE`. Prints `holding` once the mutex is held, holds it
// for HOLD_MS, creates DONE_FILE, releases, and prints `released`.

import java.nio.file.Files;
import java.nio.file.Path;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;

public class CuratorLock {
    public static void main(String[] args) throws Exception {
        String connect = args[0];
        String path = args[1];
        long holdMillis = Long.parseLong(args[2]);
        Path done = Path.of(args[3]);
        try (CuratorFramework client =
                CuratorFrameworkFactory.newClient(connect, 10_000, 5_000, new RetryNTimes(3, 200))) {
            client.start();
            InterProcessMutex mutex = new InterProcessMutex(client, path);
            mutex.acquire();
            System.out.println("holding");
            System.out.flush();
            Thread.sleep(holdMillis);
            Files.writeString(done, "done");
            mutex.release();
            System.out.println("released");
            System.out.flush();
        }
    }
}
